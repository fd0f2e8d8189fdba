"""What the spare-node keepers of both schedulers share (`workers.detectors.slurm_spares`,
`workers.detectors.kube_spares`).

A job started with `--spare-nodes N --remote` registers how a node agent of it starts (`spare_node`
in its `job.json`: N, a node's worth of spares, its script and arguments). A keeper reads every job
asking, asks each for its status over its authenticated control channel (the job's own view: which
of its nodes are idle spare nodes), and starts what is missing on its scheduler. Every figure is
re-read at each pass, so a restarted keeper starts nothing twice; what it starts is bounded per job
and window.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from job_agent import wire
from job_agent.coordinator.jobs import ask, registered_jobs
from workers.detectors.reports import ASK_TIMEOUT, MAX_JOBS

log = logging.getLogger("torchpass.detect")
# beyond a job's N, per window: spare nodes that ended before joining, started again
RETRY_STARTS = 2
START_WINDOW = timedelta(minutes=10)
MAX_AT_ONCE = 64


@dataclass(frozen=True)
class Wanted:
    """One running job's spare nodes, as it registered them, and its status now."""

    job_id: str
    count: int
    spares: int  # warm spares a spare node keeps: a node's worth of ranks
    script: str
    args: tuple[str, ...]
    status: wire.Status


def wanted(state_dir: Path, timeout: timedelta = ASK_TIMEOUT) -> tuple[list[Wanted], set[str]]:
    """The training jobs under `state_dir` asking for spare nodes, each with its status; and the ids
    of every job whose coordinator runs."""
    running: set[str] = set()
    out = []
    for info in registered_jobs(state_dir)[:MAX_JOBS]:
        if not info["alive"]:
            continue
        job_id = str(info.get("job_id", ""))
        running.add(job_id)
        if (w := _asking(job_id, info, timeout)) is not None:
            out.append(w)
    return out, running


def _asking(job_id: str, info: dict[str, Any], timeout: timedelta) -> Wanted | None:
    want = info.get("spare_node")
    if not isinstance(want, dict):
        return None
    try:
        count, spares = int(want["count"]), int(want["spares"])
        script, args = str(want["script"]), tuple(str(a) for a in want["args"])
    except (KeyError, TypeError, ValueError) as e:
        log.warning("job %s asks for spare nodes unreadably (%r): none kept", job_id, e)
        return None
    try:
        status = ask(info, wire.StatusRequest(), timeout)
    except Exception as e:  # gone or not listening yet: the next pass asks again
        log.info("job %s not reached for its spare nodes: %s", job_id, e)
        return None
    if not isinstance(status, wire.Status) or status.state != "training":
        return None  # starting (its own nodes still joining) or ending: nothing to keep
    return Wanted(job_id, count, spares, script, args, status)


def missing(count: int, status: wire.Status, running_on: Iterable[str | None]) -> int:
    """Spare nodes a job still lacks: `count` less its idle nodes (joined, no rank, not cordoned or
    drained, as the job says) and the spare nodes started but not yet joined (`running_on`: where
    each runs, None while it waits for a node; one whose agent has not joined yet is on its way)."""
    joining = [n for n in running_on if n is None or n not in status.nodes]
    return max(0, min(MAX_AT_ONCE, count - len(status.idle_nodes) - len(joining)))


class Budget:
    """At most a job's N + RETRY_STARTS starts per START_WINDOW: a spare node whose agent cannot
    start ends at once, and would otherwise be started again at every pass."""

    def __init__(self) -> None:
        self._started: dict[str, deque[float]] = {}

    def take(self, job_id: str, count: int) -> bool:
        now = time.monotonic()
        recent = self._started.setdefault(job_id, deque())
        while recent and now - recent[0] > START_WINDOW.total_seconds():
            recent.popleft()
        if len(recent) >= count + RETRY_STARTS:
            log.error(
                "job %s: %d spare nodes started within %s; not more",
                job_id,
                len(recent),
                START_WINDOW,
            )
            return False
        recent.append(now)
        return True
