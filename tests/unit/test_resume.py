"""Where a job that did not finish resumes (`job_agent.coordinator.resume`), read from real files in
a job directory as a lost coordinator, a stopped job and a finished one leave them."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from job_agent import wire
from job_agent.coordinator.jobs import JobIdInUse, register_job, registered_jobs, unregister_job
from job_agent.coordinator.members import Member
from job_agent.coordinator.progress import StepTracker
from job_agent.coordinator.resume import (
    MAX_PENDING_SHARDS,
    PROGRESS,
    Checkpoints,
    ProgressFile,
    latest_checkpoint,
    prepare,
    resume_point,
)
from torchpass.job import JobResult, JobState

DEAD = 2**22 + 7  # no such process


def _job(tmp_path: Path, pid: int | None = DEAD) -> Path:
    job_dir = tmp_path / "jobs" / "j"
    register_job(job_dir, b"s" * 32, "127.0.0.1:1", 2)
    if pid is None:
        unregister_job(job_dir)
    else:
        info = json.loads((job_dir / "job.json").read_text())
        (job_dir / "job.json").write_text(json.dumps({**info, "pid": pid}))
    return job_dir


def _checkpoints(job_dir: Path, *steps: int) -> None:
    (job_dir / "checkpoints").mkdir(exist_ok=True)
    for step in steps:
        (job_dir / "checkpoints" / f"step-{step:08d}.pt").write_bytes(b"x")


def test_a_lost_coordinators_job_resumes_from_its_latest_checkpoint_and_says_how_far_it_got(
    tmp_path: Path,
) -> None:
    job_dir = _job(tmp_path)
    _checkpoints(job_dir, 9, 19, 99)  # by number, not by name: 99 < 100 would sort wrongly unpadded
    (job_dir / "checkpoints" / "step-00000100.pt").write_bytes(b"x")
    ProgressFile(job_dir).write(117)
    resumed = prepare(job_dir, fresh=False)
    assert resumed is not None and f"(pid {DEAD}) was lost" in resumed.previous
    assert (resumed.last_completed, resumed.checkpoint_step) == (117, 100)
    assert resumed.checkpoint == str(job_dir / "checkpoints" / "step-00000100.pt")


def test_a_stopped_job_resumes_a_finished_one_starts_again_and_leaves_nothing_to_mistake(
    tmp_path: Path,
) -> None:
    job_dir = _job(tmp_path, pid=None)
    _checkpoints(job_dir, 19)
    stopped = JobResult(
        job_id="j",
        status=JobState.FAILED,
        steps_completed=25,
        generation=0,
        error="stopped by SIGTERM",
    )
    (job_dir / "result.json").write_text(stopped.model_dump_json())
    resumed = resume_point(job_dir)
    assert resumed is not None and resumed.previous == "it ended failed: stopped by SIGTERM"
    # no progress file: unknown
    assert resumed.last_completed == -1 and resumed.checkpoint_step == 19
    # as a stop is recorded now: stopped in order
    now = stopped.model_copy(update={"status": JobState.STOPPED})
    (job_dir / "result.json").write_text(now.model_dump_json())
    resumed = resume_point(job_dir)
    assert resumed is not None and resumed.previous == "it ended stopped: stopped by SIGTERM"

    finished = stopped.model_copy(update={"status": JobState.FINISHED, "error": None})
    (job_dir / "result.json").write_text(finished.model_dump_json())
    ProgressFile(job_dir).write(59)
    # a finished job's kept checkpoints are not this run's
    assert prepare(job_dir, fresh=False) is None
    assert not (job_dir / "checkpoints").exists() and not (job_dir / PROGRESS).exists()
    assert not (job_dir / "result.json").exists()


def test_fresh_discards_an_unfinished_run_and_a_running_job_is_never_touched(
    tmp_path: Path,
) -> None:
    job_dir = _job(tmp_path)
    _checkpoints(job_dir, 19)
    assert prepare(job_dir, fresh=True) is None and not (job_dir / "checkpoints").exists()

    running = _job(tmp_path, pid=os.getppid())  # alive, and not this process
    _checkpoints(running, 39)
    with pytest.raises(JobIdInUse):
        prepare(running, fresh=True)
    assert (running / "checkpoints" / "step-00000039.pt").exists()


def test_a_job_never_run_or_with_an_unreadable_result_has_nothing_to_resume(tmp_path: Path) -> None:
    assert prepare(tmp_path / "jobs" / "new", fresh=False) is None
    job_dir = _job(tmp_path, pid=None)
    (job_dir / "result.json").write_text("{not json")
    assert resume_point(job_dir) is None


def test_the_progress_file_follows_the_ranks_high_water_atomically_and_owner_only(
    tmp_path: Path,
) -> None:
    job_dir = _job(tmp_path)
    tracker = StepTracker(ProgressFile(job_dir).write)
    tracker.entered(0, 5, -1)
    tracker.entered(1, 3, -1)  # behind the high water: nothing written
    assert json.loads((job_dir / PROGRESS).read_text()) == {"completed": 4}
    assert stat.S_IMODE((job_dir / PROGRESS).stat().st_mode) == 0o600
    assert not list(job_dir.glob("*.tmp"))


def test_a_lost_job_stays_listed_and_says_so(tmp_path: Path) -> None:
    _job(tmp_path)
    (job,) = registered_jobs(tmp_path)
    assert job["job_id"] == "j" and job["alive"] is False
    # a group, not a process
    (tmp_path / "jobs" / "j" / "job.json").write_text(json.dumps({"pid": 0}))
    assert registered_jobs(tmp_path)[0]["alive"] is False


def _rank(slot: int, sharded: bool) -> Member:
    m = Member(agent_id=f"r{slot}", role=wire.Role.RANK, slot=slot, pid=slot, node="n")
    m.layout = wire.ShardLayout(
        shard=f"s{slot}", parallelism="sharded" if sharded else "data_parallel"
    )
    return m


def test_a_data_parallel_checkpoint_is_rank_0s_file() -> None:
    c = Checkpoints()
    c.saved(_rank(1, False), 19, "/c/step-19.rank-1.pt", 4)  # no other rank saves one
    c.saved(_rank(0, False), 19, "/c/step-19.pt", 4)
    assert list(c) == [(19, "/c/step-19.pt")]


def test_a_sharded_checkpoint_counts_once_every_rank_saved_its_shard() -> None:
    c = Checkpoints()
    for slot in (0, 2, 1):
        c.saved(_rank(slot, True), 19, f"/c/{slot}", 4)
    assert not c  # rank 3 may have died before saving its shard: not a checkpoint to restart from
    c.saved(_rank(3, True), 19, "/c/3", 4)
    assert list(c) == [(19, "/c/0")]  # rank 0's file: each rank finds its own beside it
    c.saved(_rank(3, True), 19, "/c/3", 4)  # said again: counted once
    assert len(c) == 1


def test_pending_sharded_checkpoints_are_bounded() -> None:
    c = Checkpoints()
    for step in range(MAX_PENDING_SHARDS * 3):
        c.saved(_rank(1, True), step, "/c/1", 2)  # rank 0 never saves
    assert not c and len(c._shards) <= MAX_PENDING_SHARDS


def test_a_sharded_checkpoint_is_resumed_from_only_with_every_ranks_shard(tmp_path: Path) -> None:
    d = tmp_path / "checkpoints"
    d.mkdir()
    for name in ("step-00000019.pt", "step-00000019.rank-1.pt", "step-00000019.rank-2.pt"):
        (d / name).touch()
    # rank 1 lost before it saved step 39
    for name in ("step-00000039.pt", "step-00000039.rank-2.pt"):
        (d / name).touch()
    assert latest_checkpoint(tmp_path) == (19, d / "step-00000019.pt")
    (d / "step-00000039.rank-1.pt").touch()
    assert latest_checkpoint(tmp_path) == (39, d / "step-00000039.pt")


def test_steps_an_incident_counts_as_recomputed_count_in_the_result_before_they_are_run_again() -> (
    None
):
    """A restart from step 9's checkpoint after step 15 was completed: the incident counts 6 steps
    (10 to 15) run again, and so does the job's result, even when the job is stopped after only 4
    of them re-ran (the incident said 6 where result.json said 4)."""
    tracker = StepTracker()
    for k in range(16):
        tracker.entered(0, k, k - 1)
    tracker.completed(15)
    tracker.begin_generation()
    tracker.entered(0, 10, 9)  # the restarted rank, from the checkpoint
    assert tracker.recomputed_after(15) == 6
    for k in range(11, 14):  # stopped after re-running 10..13
        tracker.entered(0, k, k - 1)
    assert sorted(tracker.recomputed) == list(range(10, 16))
