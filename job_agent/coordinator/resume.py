"""A job that did not finish resumes where it stopped: `torchpass run` again with the same job id.

A coordinator SIGKILLed (or OOM-killed, or its host rebooted) takes its ranks with it (they die of
its death: `launcher.death_signal`) and leaves its registration behind; one stopped by a signal (a
scheduler's preemption) or failed leaves a result that is not "finished". Either way the job's
directory still holds its latest fallback checkpoints and the most advanced step its ranks reported
completing (`progress.json`, rewritten as that step advances). The next run of the same job id
restarts every rank from the latest checkpoint and counts, from the ranks' own step reports, the
completed steps it runs again; its result says which run it resumed and why that one ended.
`--fresh` discards all of it and starts at step 0.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from job_agent.coordinator.jobs import refuse_if_running, registered_pid
from job_agent.coordinator.private_files import replace_private
from torchpass.job import JobState, Resumed

if TYPE_CHECKING:
    from job_agent.coordinator.members import Member

PROGRESS = "progress.json"
_CHECKPOINT = "step-*.pt"


class ProgressFile:
    """The most advanced step the job's ranks reported completing, on disk: what a later run
    measures the steps it redoes against. Atomic (a crash mid-write leaves the previous value),
    owner-only."""

    def __init__(self, job_dir: Path) -> None:
        self._path = job_dir / PROGRESS
        self._written = -1

    def write(self, completed: int) -> None:
        if completed <= self._written or not self._path.parent.is_dir():
            return
        replace_private(self._path, json.dumps({"completed": completed}))
        self._written = completed

    def remove(self) -> None:
        self._path.unlink(missing_ok=True)


MAX_PENDING_SHARDS = 16


def latest_checkpoint(job_dir: Path) -> tuple[int, Path] | None:
    """The job's latest fallback checkpoint and its step (from its name, `step-<step>.pt`). A
    sharded job's (`step-<step>.rank-<r>.pt` beside it for every other rank) counts only with every
    rank's shard: a rank lost before it saved leaves that step incomplete, and the one before is
    taken."""
    found: list[tuple[int, Path]] = []
    shards: dict[int, set[int]] = {}
    for path in (job_dir / "checkpoints").glob(_CHECKPOINT):
        number, _, rank = path.name.removesuffix(".pt").removeprefix("step-").partition(".rank-")
        if number.isdigit() and not rank:
            found.append((int(number), path))
        elif number.isdigit() and rank.isdigit():
            shards.setdefault(int(number), set()).add(int(rank))
    world = 1 + max((max(r) for r in shards.values()), default=0)
    complete = [(n, p) for n, p in found if shards.get(n, set()) == set(range(1, world))]
    return max(complete, default=None)


def prepare(job_dir: Path, fresh: bool) -> Resumed | None:
    """Before the job registers: where it resumes, or None, its earlier runs' leftovers discarded so
    that none is ever mistaken for this run's (a finished run's kept checkpoints included).
    `JobIdInUse` if the job id is running here now (nothing is touched)."""
    refuse_if_running(job_dir)
    resumed = None if fresh else resume_point(job_dir)
    if resumed is None:
        start_fresh(job_dir)
    return resumed


def resume_point(job_dir: Path) -> Resumed | None:
    """Where this job resumes, if its last run did not finish; None when there is nothing to resume
    (it never ran, or it finished). Read before the job registers (which replaces a dead
    coordinator's entry and refuses a live one's)."""
    pid = registered_pid(job_dir)
    # registered, not running (`prepare`), never unregistered: it died without a word
    if pid is not None:
        why = f"its coordinator (pid {pid}) was lost"
    else:
        try:
            last = json.loads((job_dir / "result.json").read_text())
            status, error = JobState(last["status"]), last.get("error")
        except (OSError, ValueError, KeyError, TypeError):
            return None  # never ran here, or a result nobody can read: nothing to resume from
        if status is JobState.FINISHED:
            return None
        why = f"it ended {status.value}" + (f": {str(error)[:500]}" if error else "")
    try:
        completed = int(json.loads((job_dir / PROGRESS).read_text())["completed"])
    except (OSError, ValueError, KeyError, TypeError):
        completed = -1
    checkpoint = latest_checkpoint(job_dir)
    return Resumed(
        previous=why,
        last_completed=completed,
        checkpoint_step=checkpoint[0] if checkpoint else -1,
        checkpoint=str(checkpoint[1]) if checkpoint else None,
    )


def start_fresh(job_dir: Path) -> None:
    """`--fresh`: forget every earlier run of this job id (its checkpoints, progress, result,
    record)."""
    shutil.rmtree(job_dir / "checkpoints", ignore_errors=True)
    for name in (PROGRESS, "result.json"):
        with contextlib.suppress(FileNotFoundError):
            (job_dir / name).unlink()


class Checkpoints(list[tuple[int, str]]):
    """The job's complete fallback checkpoints, oldest first, as (step, rank 0's file). A
    data-parallel job's is rank 0's file alone; a sharded job's is complete once every rank said it
    saved its shard."""

    def __init__(self) -> None:
        super().__init__()
        self._shards: dict[int, tuple[set[int], str | None]] = {}

    def saved(self, m: Member, step: int, path: str, world_size: int) -> None:
        slot, sharded = m.slot, m.layout is not None and m.layout.parallelism == "sharded"
        if not sharded:
            if slot == 0:
                self.append((step, path))
            return
        if self and step <= self[-1][0]:
            return
        slots, first = self._shards.setdefault(step, (set(), None))
        slots.add(slot)
        first = path if slot == 0 else first
        self._shards[step] = (slots, first)
        if len(slots) >= world_size and first is not None:
            self.append((step, first))
            self._shards = {k: v for k, v in self._shards.items() if k > step}
        # ranks that never all save: forget the oldest
        while len(self._shards) > MAX_PENDING_SHARDS:
            del self._shards[min(self._shards)]
