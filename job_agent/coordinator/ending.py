"""How a job ends: its result, from what its ranks and incidents reported, and its files put
away."""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import time
from collections import Counter
from collections.abc import Callable
from typing import Protocol

from job_agent import wire
from job_agent.coordinator.incident.tracker import IncidentTracker
from job_agent.coordinator.jobs import unregister_job
from job_agent.coordinator.members import Member, Roster
from job_agent.coordinator.private_files import open_private
from job_agent.coordinator.progress import StepTracker
from job_agent.coordinator.resume import ProgressFile
from job_agent.launch.launcher import Launcher, signal_name
from torchpass.job import JobResult, JobSpec, JobState, Resumed


class Ended(Protocol):
    """What a job's result is read from (its coordinator)."""

    spec: JobSpec
    state: JobState
    roster: Roster
    progress: StepTracker
    incidents: IncidentTracker
    resumed: Resumed | None
    error: str | None
    restarts: int
    # the ranks as the job began to end (`held`): their last reports, even once they exited
    held: list[Member]

    @property
    def generation(self) -> int: ...


def diverged(ranks: list[Member]) -> str | None:
    """Why the replicas' final states are not one state: the ranks whose digest differs from the
    majority of the ranks holding the same shard (a data-parallel job's ranks all hold one), from
    silent divergence or corruption. None when every shard's replicas agree."""
    shards: dict[str | None, list[Member]] = {}
    for m in ranks:
        if m.digest:
            shards.setdefault(m.layout.shard if m.layout else None, []).append(m)
    odd: list[int] = []
    for replicas in shards.values():
        majority, _ = Counter(m.digest for m in replicas).most_common(1)[0]
        odd += [m.slot for m in replicas if m.digest != majority]
    if not odd:
        return None
    return (
        f"the replicas ended with different states: rank(s) {', '.join(map(str, sorted(odd)))} "
        "differ from the other replicas of their shard (a step that does not replay the same on "
        "every rank, or corruption)"
    )


def final_digest(ranks: list[Member]) -> str | None:
    """The job's final state as one digest: the ranks' own when they all hold one state (data
    parallel); for a sharded job, one over each shard's digest in the order of the first slot
    holding it. None when some shard's replicas disagree or some rank reported none (no rank at
    all included: never the digest of an empty state)."""
    if not ranks:
        return None
    shards: dict[str | None, set[str]] = {}
    for m in sorted(ranks, key=lambda m: m.slot):
        shards.setdefault(m.layout.shard if m.layout else None, set()).add(m.digest or "")
    if any(len(d) != 1 or "" in d for d in shards.values()):
        return None
    digests = [d.pop() for d in shards.values()]
    if len(digests) == 1:
        return digests[0]
    return hashlib.sha256("\n".join(digests).encode()).hexdigest()


def job_result(job: Ended) -> JobResult:
    ranks, incidents = job.held or job.roster.ranks(), job.incidents
    state, error = job.state, job.error
    if state in (JobState.FINISHED, JobState.STOPPED) and (why := diverged(ranks)):
        state, error = JobState.FAILED, why
    kept = (JobState.FINISHED, JobState.USER_ERROR, JobState.STOPPED)
    # what every rank completed, measured: the ranks' own reports, else the steps' high water
    completed = max((m.completed for m in ranks), default=job.progress.high_water)
    return JobResult(
        job_id=job.spec.job_id,
        status=state if state in kept else JobState.FAILED,
        steps_completed=completed + 1,
        final_digest=final_digest(ranks),
        generation=job.generation,
        steps_recomputed=len(job.progress.recomputed),
        incidents=tuple(incidents.outcomes),
        refuted_claims=tuple(incidents.refuted),
        refuted_claims_total=incidents.refuted_total,
        reports_undelivered=incidents.undelivered,
        incidents_unfiled=sum(inc.record is not None for inc in incidents.records.handled.values()),
        resumed=job.resumed,
        restarts=job.restarts,
        error=error,
    )


async def stop_at_a_step_boundary(ranks: list[Member], wait: float) -> bool:
    """A stopped job's ranks freeze at one step boundary, then each says what it holds (`Done`: its
    step and state digest) and exits, its code after the loop not run (`wire.Stop`). False when
    they did not all freeze within `wait` seconds (a rank lost, a script that never reaches a
    boundary): they are then told to exit as they are, and the result says no digest."""
    training = [m for m in ranks if m.alive]
    if not training or len(training) != len(ranks):
        return False
    for m in training:
        m.send(wire.Freeze())
    if not await _until(lambda: all(m.state is wire.MemberState.FROZEN for m in training), wait):
        return False
    for m in training:
        m.send(wire.Stop())
    return await _until(lambda: all(m.state is wire.MemberState.DONE for m in training), wait)


async def _until(pred: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not pred():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


def user_error(slot: int, step: int | None, tb: str) -> str:
    """The job's error when a rank's script raised (`wire.UserError`)."""
    where = "before training" if step is None or step < 0 else f"at step {step}"
    return (
        f"rank {slot} failed in the training script {where} (not a migration; its traceback is "
        f"above):\n{tb.rstrip()}"
    )


def judge_exits(job: Ended, launcher: Launcher, late: set[str]) -> None:
    """A job whose ranks finished training is ok only if their code after the training loop ended
    well too: a rank that exited with an error then, or was still running when the grace ran out
    (`late`, then stopped), makes it the script's failure, named in the result."""
    if job.state is not JobState.FINISHED:
        return
    problems = []
    for m in job.roster.ranks():
        code = launcher.poll(m.agent_id)
        if m.agent_id in late:
            problems.append(
                f"rank {m.slot} was still running its code after the training loop "
                f"{job.spec.finish_grace:.0f} s after training finished, and was stopped "
                "(--finish-grace)"
            )
        elif code:  # None: its node did not say; 0: a clean exit
            problems.append(
                f"rank {m.slot} exited ({signal_name(code)}) after the training loop; see its "
                "output"
            )
    if problems:
        job.state, job.error = JobState.USER_ERROR, "; ".join(problems)


def put_away(spec: JobSpec, result: JobResult, progress_file: ProgressFile) -> None:
    """`result.json` written, the job unregistered (its secret removed); a finished job's progress
    and (unless kept) checkpoints removed."""
    with open_private(spec.job_dir / "result.json") as f:
        f.write(result.model_dump_json(indent=2))
    unregister_job(spec.job_dir)
    if result.status is JobState.FINISHED:
        progress_file.remove()
        if not spec.keep_checkpoints_after:
            # Only a restart reads them: a finished job's would fill the state directory.
            shutil.rmtree(spec.job_dir / "checkpoints", ignore_errors=True)
