"""Spare nodes for Slurm jobs, from a spare partition or reservation (run by the Slurm detector).

A job started with `--spare-nodes N` (the sbatch template's `KEEP_SPARE_NODES`) asks to have N idle
spare nodes. Each is a one-node Slurm job of its own, submitted to the configured spare partition
and/or reservation and named `torchpass-spare-<job id>`, that runs the job's node agent with no
slots and as many warm spares as a node of the job runs ranks (`torchpass node --slots 0 --spares
S`, the job's script and arguments as the job registered them). It joins the running job as a spare
node: a drained or failed node's ranks move to its spares.

At each poll, for every job under the state directory asking for spare nodes, the keeper counts the
job's joined nodes that run no rank (idle: the allocation's own spare nodes count too) and its
spare-node Slurm jobs not yet joined (pending, configuring, or running before their agent joined),
and submits the difference. A spare node whose spares took over a drained node's ranks is idle no
more: the next poll asks Slurm for another, which waits in the queue until the partition has a node.
Everything is re-read each time (Slurm's queue and the job's own status), so a restarted detector
submits nothing twice.

Bounds: a job gets at most its N plus `spare_nodes.RETRY_STARTS` submissions per `START_WINDOW` (a
node agent that cannot start ends at once and would otherwise be submitted again at every poll). A
spare-node job whose job no longer runs (its directory is here, its coordinator is not) is
cancelled.
"""

from __future__ import annotations

import logging
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from workers.detectors.reports import ASK_TIMEOUT
from workers.detectors.slurm import SEP, SlurmError, slurm
from workers.detectors.spare_nodes import Budget, Wanted, missing, wanted

log = logging.getLogger("torchpass.slurm")
PREFIX = "torchpass-spare-"
_WAITING = "PENDING,CONFIGURING,RUNNING"


class SpareNodeSettings(BaseModel):
    """Where spare nodes come from and how their node agent starts there."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    partition: str | None = Field(default=None, min_length=1, max_length=200)
    reservation: str | None = Field(default=None, min_length=1, max_length=200)
    node_command: str = Field(
        default="torchpass",
        min_length=1,
        max_length=1000,
        description="how a spare node runs torchpass",
    )
    host_command: str = Field(
        default="hostname -i",
        min_length=1,
        max_length=1000,
        description="prints the spare node's address, reachable from every other node",
    )
    sbatch_args: tuple[str, ...] = Field(
        default=(), max_length=32, description="e.g. --account, --time"
    )

    @model_validator(mode="after")
    def _somewhere(self) -> SpareNodeSettings:
        if self.partition is None and self.reservation is None:
            raise ValueError("spare nodes need a partition or a reservation to come from")
        return self


@dataclass(frozen=True)
class Queued:
    """One of our spare-node jobs in Slurm's queue."""

    slurm_id: str
    name: str
    state: str
    node: str  # "" until it runs


def job_name(job_id: str) -> str:
    return f"{PREFIX}{job_id}"


def read_queue(run: Callable[[Sequence[str]], str] = slurm) -> list[Queued]:
    """Our spare-node jobs that are waiting or running (every user's queue is read, ours kept)."""
    out = run(["squeue", "--noheader", f"--states={_WAITING}", f"--format=%i{SEP}%j{SEP}%T{SEP}%N"])
    queued = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(SEP)]
        if len(parts) != 4:
            raise SlurmError(f"squeue: unreadable line {line[:200]!r}")
        if parts[1].startswith(PREFIX):
            queued.append(Queued(parts[0], parts[1], parts[2].upper(), parts[3]))
    return queued


class SlurmSpares:
    """Keeps every job's spare nodes; `keep` is called at each poll of the Slurm detector."""

    def __init__(
        self,
        state_dir: Path,
        settings: SpareNodeSettings,
        run: Callable[[Sequence[str]], str] = slurm,
        timeout: timedelta = ASK_TIMEOUT,
    ) -> None:
        self.state_dir = state_dir
        self.settings = settings
        self._run = run
        self._timeout = timeout
        self._budget = Budget()

    def keep(self) -> list[str]:
        """One pass over the jobs; the Slurm ids of the spare-node jobs it submitted."""
        try:
            queued = read_queue(self._run)
        except SlurmError as e:
            log.warning("the queue could not be read; no spare node kept this time: %s", e)
            return []
        jobs, running = wanted(self.state_dir, self._timeout)
        submitted = []
        for w in jobs:
            mine = [
                q.node if q.state == "RUNNING" else None
                for q in queued
                if q.name == job_name(w.job_id)
            ]
            for _ in range(missing(w.count, w.status, mine)):
                if (
                    not self._budget.take(w.job_id, w.count)
                    or (slurm_id := self._submit(w)) is None
                ):
                    break
                submitted.append(slurm_id)
        self._cancel_orphans(queued, running)
        return submitted

    def _submit(self, w: Wanted) -> str | None:
        s, job_id, job_dir = self.settings, w.job_id, self.state_dir / "jobs" / w.job_id
        node = shlex.join(["node", "--job", job_id, "--slots", "0", "--spares", str(w.spares)])
        rest = shlex.join(["--watch-path", str(self.state_dir), w.script, *w.args])
        state_dir = shlex.quote(str(self.state_dir))
        command = (
            f"export TORCHPASS_STATE_DIR={state_dir}; exec {s.node_command} {node}"
            f' --name "$SLURMD_NODENAME" --host "$({s.host_command})" {rest}'
        )
        argv = [
            "sbatch",
            "--parsable",
            f"--job-name={job_name(job_id)}",
            "--nodes=1",
            "--ntasks=1",
            "--exclusive",
        ]
        argv += [f"--output={job_dir}/spare-node-%j.out"]
        argv += [f"--partition={s.partition}"] if s.partition else []
        argv += [f"--reservation={s.reservation}"] if s.reservation else []
        try:
            out = self._run([*argv, *s.sbatch_args, "--wrap", command])
        except SlurmError as e:
            log.warning("job %s: a spare node could not be submitted: %s", job_id, e)
            return None
        slurm_id = out.strip().split(";", 1)[0]
        log.warning("job %s: spare node asked of Slurm (job %s)", job_id, slurm_id)
        return slurm_id

    def _cancel_orphans(self, queued: list[Queued], running: set[str]) -> None:
        """Spare-node jobs of this state directory's jobs that no longer run."""
        for q in queued:
            job_id = q.name[len(PREFIX) :]
            if job_id not in running and (self.state_dir / "jobs" / job_id).is_dir():
                try:
                    self._run(["scancel", q.slurm_id])
                except SlurmError as e:
                    log.warning(
                        "spare node %s of ended job %s not cancelled: %s", q.slurm_id, job_id, e
                    )
                else:
                    log.warning(
                        "spare node %s cancelled: job %s no longer runs", q.slurm_id, job_id
                    )
