"""Real failures of real ranks, live-migrated through MigrationWorkflow on the real dev server.

Each test checks the final state is bitwise equal to an uninterrupted run, and that no completed
step was recomputed (counted independently by the coordinator from the ranks' step reports).
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path

import pytest
from temporalio.client import Client

from job_agent import wire
from job_agent.coordinator.jobs import request, wait_until_ready
from tests.integration.conftest import run_with, spec, start_job
from torchpass.cli import main
from torchpass.ids import SA_JOB_ID
from torchpass.job import JobResult, JobState
from torchpass.models import Category, Disposition, FailureKind, Phase
from workers.job import run_job

pytestmark = pytest.mark.integration


def title_of(pid: int) -> bytes:
    """A process's command line as `ps` shows it (a forked rank's names its job and agent)."""
    return Path(f"/proc/{pid}/cmdline").read_bytes()


def assert_migrated_live(result: JobResult, reference: JobResult, incidents: int) -> None:
    assert result.ok, result.error
    assert len(result.incidents) == incidents
    for o in result.incidents:
        assert o.disposition == Disposition.MIGRATED and o.success, o
        assert o.steps_recomputed == 0 and o.step_before is not None
        assert set(o.resumed_steps.values()) == {o.step_before + 1}  # as each rank reported it
        assert o.proof is not None and o.proof.donor_digest in o.proof.receiver_digests.values()
        # what each receiver computed itself once it installed the state
        for r in o.proof.receivers:
            assert (r.installed_digest, r.installed_step) == (
                o.proof.donor_digest,
                o.proof.step_after,
            )
        assert {p.phase for p in o.phases} >= {
            Phase.CONFIRM,
            Phase.FREEZE,
            Phase.TRANSFER,
            Phase.REJOIN,
        }
    assert result.steps_recomputed == 0
    assert result.final_digest == reference.final_digest


async def test_kill_of_a_nonzero_rank_is_migrated_live(
    client: Client, reference: JobResult, tmp_path: Path
) -> None:
    result = await run_with(client, spec(tmp_path, "kill-rank-2"), [("kill", 2, 20)])
    assert_migrated_live(result, reference, 1)
    o = result.incidents[0]
    assert o.kind == FailureKind.PROCESS_EXIT and o.lost_slots == (2,)
    assert o.classification.qualifying


async def test_kill_of_rank_0_is_migrated_live(
    client: Client, reference: JobResult, tmp_path: Path
) -> None:
    result = await run_with(client, spec(tmp_path, "kill-rank-0"), [("kill", 0, 25)])
    assert_migrated_live(result, reference, 1)
    assert result.incidents[0].lost_slots == (0,)
    assert result.incidents[0].proof is not None and result.incidents[0].proof.donor_slot != 0


async def test_a_hung_rank_is_fenced_and_migrated_live(
    client: Client, reference: JobResult, tmp_path: Path
) -> None:
    job = spec(tmp_path, "hang-rank-1")
    result = await run_with(client, job, [("hang", 1, 30)])
    assert_migrated_live(result, reference, 1)
    (o,) = result.incidents
    assert o.kind == FailureKind.HANG
    # Timed from detection and from the hung rank's last progress: the hang timeout is not hidden.
    # The two figures differ by the time the rank went without progress before it was found hung: a
    # hang timeout (two thirds of it: slack for the clocks the two instants are read from).
    assert o.last_progress_at is not None and o.last_progress_at < o.detected_at
    assert o.recovery_seconds is not None and o.recovery_from_last_progress_seconds is not None
    assert o.recovery_from_last_progress_seconds - o.recovery_seconds >= 2 / 3 * job.hang_timeout


async def test_two_failures_in_one_run_are_both_migrated_live(
    client: Client, reference: JobResult, tmp_path: Path
) -> None:
    result = await run_with(
        client, spec(tmp_path, "two-failures"), [("kill", 3, 15), ("hang", 0, 40)]
    )
    assert_migrated_live(result, reference, 2)
    assert [o.lost_slots for o in result.incidents] == [(3,), (0,)]


async def test_incidents_are_searchable_by_job(
    client: Client, reference: JobResult, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = await run_with(client, spec(tmp_path, "searchable"), [("kill", 1, 10)])
    assert_migrated_live(result, reference, 1)
    found = [wf.id async for wf in client.list_workflows(f"{SA_JOB_ID} = 'searchable'")]
    incident = result.incidents[0].incident_id
    assert found == [incident.split("/")[0]]
    # `incidents show` takes the id as listed and as the job's summary prints it (with its run id).
    address = client.service_client.config.target_host
    for shown in (found[0], incident):
        assert (
            await asyncio.to_thread(main, ["incidents", "show", shown, "--address", address]) == 0
        )
        assert f"incident   {incident}" in capsys.readouterr().out


async def test_a_collective_that_times_out_with_every_rank_alive_re_forms_in_place(
    client: Client, reference: JobResult, tmp_path: Path
) -> None:
    """Rank 1 stalls (SIGSTOP, SIGCONT 3 s later) past the 1 s collective timeout but within the 5 s
    hang timeout: its peers' collective times out, then its own fails, and nobody is lost. The group
    re-forms in place for the next generation, no spare taken, no step recomputed."""
    job = spec(tmp_path, "stall-rank-1", hang_timeout=5.0, collective_timeout=1.0)
    task = await start_job(client, job)
    try:
        pause = wire.Inject(action=wire.InjectAction.PAUSE, slot=1, after_step=20, seconds=3.0)
        assert isinstance(
            await asyncio.to_thread(request, job.state_dir, job.job_id, pause), wire.Ok
        )
        result = await asyncio.wait_for(asyncio.shield(task), 150)
    finally:
        if not task.done():
            task.cancel()
    assert result.ok, result.error
    assert result.final_digest == reference.final_digest and result.steps_recomputed == 0
    (o,) = result.incidents
    assert o.kind == FailureKind.COLLECTIVE_TIMEOUT and o.lost_slots == ()
    assert o.disposition == Disposition.MIGRATED and o.success and o.classification.qualifying
    assert (
        o.proof is not None
        and o.proof.receiver_slots == ()
        and o.proof.step_before == o.proof.step_after
    )
    assert result.generation == 1  # re-formed once, in place


async def test_a_planned_drain_moves_a_healthy_rank_to_the_spare(
    client: Client, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`torchpass drain`: rank 2 is healthy; every rank freezes at a step boundary, then rank 2 is
    fenced and the spare takes its slot with state from a survivor. Before it, `torchpass status`
    shows each rank's process: the pid is the process of that job and agent (its command line says
    so: it is forked), and the local rank the one it was started with."""
    job = spec(tmp_path, "drain-rank-2", args=("--steps", "120", "--width", "128", "--depth", "2"))
    task = asyncio.create_task(run_job(job, client))
    try:
        await asyncio.to_thread(wait_until_ready, job.state_dir, job.job_id, timedelta(seconds=60))
        env = {"TORCHPASS_STATE_DIR": str(job.state_dir)}
        with pytest.MonkeyPatch.context() as mp:
            for k, v in env.items():
                mp.setenv(k, v)
            capsys.readouterr()
            assert await asyncio.to_thread(main, ["status", "--job", job.job_id]) == 0
            shown = capsys.readouterr().out.splitlines()
            rows = [line.split("\t") for line in shown[2:]]
            for slot, _, _, _, local_rank, pid, agent in rows:  # one host: LOCAL_RANK is the slot
                assert int(local_rank) == int(slot)
                assert f"[torchpass {job.job_id}/{agent}]".encode() in title_of(int(pid)), (
                    pid,
                    agent,
                )
            argv = ["drain", "--job", job.job_id, "--rank", "2", "--reason", "security patch"]
            assert await asyncio.to_thread(main, argv) == 0
        assert "incident started" in capsys.readouterr().out
        result = await asyncio.wait_for(asyncio.shield(task), 150)
    finally:
        if not task.done():
            task.cancel()
    long_reference = await run_with(
        client, spec(tmp_path / "ref", "drain-reference", spares=0, args=job.args)
    )
    assert_migrated_live(result, long_reference, 1)
    assert shown[0].startswith(f"job {job.job_id}: training, generation 0, 4 ranks"), shown
    assert [int(slot) for slot, *_ in rows] == [0, 1, 2, 3], shown
    (o,) = result.incidents
    assert o.kind == FailureKind.NODE_DRAIN and o.lost_slots == (2,)
    assert o.classification.category == Category.PLANNED and o.classification.qualifying


async def test_checkpoints_are_bounded_and_a_finished_jobs_are_removed(
    client: Client, tmp_path: Path
) -> None:
    """22 short jobs once left 2.6 GB of checkpoints behind: a running job keeps its latest
    `keep_checkpoints`, a finished one removes them unless asked to keep them."""
    kept = spec(
        tmp_path,
        "ckpt-kept",
        spares=0,
        nproc=2,
        checkpoint_every=5,
        keep_checkpoints=1,
        keep_checkpoints_after=True,
    )
    gone = spec(tmp_path, "ckpt-gone", spares=0, nproc=2, checkpoint_every=5)
    for job in (kept, gone):
        result = await run_job(job, client)
        assert result.status == JobState.FINISHED, result
    assert [p.name for p in (kept.job_dir / "checkpoints").glob("step-*.pt")] == [
        "step-00000059.pt"
    ]
    assert not (gone.job_dir / "checkpoints").exists()
    assert (gone.job_dir / "result.json").exists()  # the record stays
