"""The Slurm detector: the nodes' states, read with `sinfo` through one subprocess function.

Each read lists every node with its state, the reason and the reason's timestamp (`sinfo --Node`):

- DRAIN, DRAINING or DRAINED -> a planned move of every rank on the node (the reason is the
  operator's);
- DOWN, FAIL, FAILING, or not responding (`*`) -> a node failure (the job takes it for one only if
  it no longer hears from the node itself).

Slurm has no watch: the detector polls (`poll_seconds`), and every read says everything again; the
keys (node, state, the reason's timestamp) make the second hearing a no-op. After a job acted on a
node's failure, the node is set to DRAIN with the reason (`scontrol update`), so that Slurm gives it
to no job until somebody repairs it and resumes it.

With spare nodes configured (`--spare-partition`, `--spare-reservation`), each poll also keeps the
spare nodes the jobs asked for (`workers.detectors.slurm_spares`).
"""

from __future__ import annotations

import logging
import subprocess
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from torchpass.models import FailureKind
from workers.detectors.reports import Jobs, Seen, acted

log = logging.getLogger("torchpass.slurm")
COMMAND_TIMEOUT = 15.0
MAX_OUTPUT = 4 << 20  # a cluster of tens of thousands of nodes reads in well under this
# no node name, state or timestamp holds it; the reason comes last and may hold anything
SEP = "\x1f"
_DRAINING = {"drain", "drained", "draining"}
_FAILED = {"down", "fail", "failing", "not_responding", "no_respond"}


class SlurmSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    poll_seconds: float = Field(default=5.0, gt=0, le=3600)
    partition: str | None = Field(
        default=None, max_length=200, description="only this partition's nodes"
    )
    drain_after_failure: bool = True


class SlurmError(Exception):
    """A Slurm command failed, timed out or said something unreadable."""


def slurm(argv: Sequence[str], timeout: float = COMMAND_TIMEOUT) -> str:
    """Run one Slurm client command (`sinfo`, `scontrol`, ...); its output. Every call goes through
    here: bounded in time and in what it reads, with the command's own words in the error."""
    try:
        done = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SlurmError(f"{argv[0]}: {e}") from None
    if done.returncode != 0:
        raise SlurmError(
            f"{' '.join(argv[:3])}: exit {done.returncode}: {done.stderr.strip()[:500]}"
        )
    if len(done.stdout) > MAX_OUTPUT:
        raise SlurmError(
            f"{argv[0]}: {len(done.stdout)} characters of output, more than {MAX_OUTPUT}"
        )
    return done.stdout


@dataclass(frozen=True)
class NodeState:
    name: str
    state: str  # sinfo's long form, lower case: "idle", "drained", "down*", "mixed-", ...
    reason: str
    since: str  # the reason's timestamp ("Unknown" where none)


def read_nodes(partition: str | None = None) -> list[NodeState]:
    """Every node (of `partition`), once each."""
    argv = ["sinfo", "--Node", "--noheader", f"--format=%N{SEP}%T{SEP}%H{SEP}%E"]
    if partition:
        argv.append(f"--partition={partition}")
    out: dict[str, NodeState] = {}
    for line in slurm(argv).splitlines():
        parts = line.split(SEP, 3)
        if len(parts) != 4 or not parts[0].strip():
            raise SlurmError(f"sinfo: unreadable line {line[:200]!r}")
        name, state, since, reason = (p.strip() for p in parts)
        out.setdefault(
            name, NodeState(name, state.lower(), "" if reason == "none" else reason, since)
        )
    return list(out.values())


def node_seen(n: NodeState) -> Seen | None:
    """What a node's state says that a job must hear."""
    base = n.state.rstrip("*~#!%$@^-+")
    words = set(base.replace("+", " ").split()) | {base}
    not_responding = n.state.endswith("*")
    if not_responding or words & _FAILED:
        why = f"State={n.state.upper()}" + (f" ({n.reason})" if n.reason else "")
        return Seen(
            n.name,
            FailureKind.NODE_FAILURE,
            f"{n.name}:{base}{'*' if not_responding else ''}:{n.since}",
            why,
        )
    if words & _DRAINING:
        return Seen(
            n.name,
            FailureKind.NODE_DRAIN,
            f"{n.name}:drain:{n.since}",
            f"State={n.state.upper()} ({n.reason or 'no reason given'})",
        )
    return None


class SlurmDetector:
    """Polls the nodes' states until `close`."""

    def __init__(
        self,
        jobs: Jobs,
        settings: SlurmSettings | None = None,
        keep_spares: Callable[[], object] | None = None,
    ) -> None:
        self.jobs = jobs
        self.settings = settings or SlurmSettings()
        # `workers.detectors.slurm_spares.SlurmSpares.keep`, at each poll
        self.keep_spares = keep_spares
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.poll()
            self.stop.wait(self.settings.poll_seconds)

    def close(self) -> None:
        self.stop.set()

    def poll(self) -> None:
        """One read of every node; each that matters is told to the jobs. Then the jobs' spare
        nodes."""
        self._tell_nodes()
        if self.keep_spares is not None:
            self.keep_spares()

    def _tell_nodes(self) -> None:
        try:
            nodes = read_nodes(self.settings.partition)
        except SlurmError as e:
            log.warning("the nodes' states could not be read: %s", e)
            return
        for n in nodes:
            seen = node_seen(n)
            if seen is None:
                continue
            jobs = acted(self.jobs.tell(seen))
            if jobs and seen.kind is FailureKind.NODE_FAILURE and self.settings.drain_after_failure:
                self._leave_drained(seen, jobs)

    def _leave_drained(self, seen: Seen, jobs: list[str]) -> None:
        why = f"torchpass: {seen.reason}; job(s) {', '.join(jobs)} moved off it"[:500]
        try:
            slurm(["scontrol", "update", f"nodename={seen.node}", "state=drain", f"reason={why}"])
        except SlurmError as e:
            log.warning("node %s not drained after the failure: %s", seen.node, e)
