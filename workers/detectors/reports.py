"""What the cluster detectors (`workers.detectors.kube`, `workers.detectors.slurm`) share: telling
the jobs what they saw.

A detector reads the scheduler's view of its nodes and turns each change that matters into a `Seen`:
a node cordoned or drained, NotReady or DOWN, a job's pod on it deleted. Every job registered under
the state directory hears it as a `wire.NodeEvent` over its authenticated control channel (a pod's
deletion only the job it belongs to). The job checks the claim against its own view and answers
whether it acted (`job_agent.coordinator.detect.cluster`); its coordinator folds what it acts on
into the incident of that node, so that the signals of one failure make one incident.

Nothing here keeps state between runs: a detector re-reads the whole cluster after a restart or a
lost watch and says everything again, and each observation's key makes the second hearing a no-op.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Literal

from job_agent import wire
from job_agent.coordinator.jobs import UnknownJob, ask, registered_jobs
from job_agent.wire.base import ID, TEXT
from torchpass.models import FailureKind

log = logging.getLogger("torchpass.detect")
ASK_TIMEOUT = timedelta(seconds=5)
# jobs told of one node in one pass: a state directory cannot make a detector unbounded
MAX_JOBS = 1024

Source = Literal["kubernetes", "slurm"]


@dataclass(frozen=True)
class Seen:
    """One observation of one node. `key` names it for good (the same state re-read gives the same
    key); `job` limits it to one job (a pod of that job), else every job hears it."""

    node: str
    kind: FailureKind
    key: str
    reason: str = ""
    job: str | None = None


@dataclass(frozen=True)
class Told:
    """A job's answer to a `Seen`: whether it acted (moved or lost ranks there), its words, or the
    error that kept it from answering (it will hear it again at the next resync)."""

    job_id: str
    acted: bool
    detail: str


class Jobs:
    """The jobs registered under `state_dir`, told what a detector of `source` saw."""

    def __init__(self, state_dir: Path, source: Source, timeout: timedelta = ASK_TIMEOUT) -> None:
        self.state_dir = state_dir
        self.source: Source = source
        self.timeout = timeout

    def tell(self, seen: Seen) -> list[Told]:
        """Every job concerned hears `seen`; their answers (a job that cannot be reached is one
        too)."""
        frame = wire.NodeEvent(
            node=seen.node,
            kind=seen.kind,
            source=self.source,
            reason=seen.reason[:TEXT],
            key=seen.key[:ID],
            observed_at=datetime.now(UTC),
        )
        out = []
        for info in registered_jobs(self.state_dir)[:MAX_JOBS]:
            job_id = str(info.get("job_id", ""))
            if seen.job is not None and job_id != seen.job:
                continue
            out.append(self._ask(job_id, info, frame))
        for t in out:
            if t.acted:
                log.warning(
                    "job %s acted on %s of node %s: %s",
                    t.job_id,
                    seen.kind.value,
                    seen.node,
                    t.detail,
                )
        return out

    def _ask(self, job_id: str, info: dict[str, object], frame: wire.NodeEvent) -> Told:
        try:
            reply = ask(info, frame, self.timeout)
        except (OSError, UnknownJob, ValueError, KeyError) as e:  # gone, or not yet listening
            return Told(job_id, False, f"not reached: {e}")
        except Exception as e:  # a malformed reply must not stop the detector
            return Told(job_id, False, f"no answer: {e!r}")
        if isinstance(reply, wire.Ok):
            acted = reply.detail.get("acted") is True
            return Told(job_id, acted, str(reply.detail))
        reason = reply.reason if isinstance(reply, wire.Error) else f"unexpected {reply.t!r}"
        return Told(job_id, False, f"refused: {reason}")


def acted(told: Iterable[Told]) -> list[str]:
    """The jobs that acted on an observation."""
    return [t.job_id for t in told if t.acted]
