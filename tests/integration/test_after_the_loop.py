"""What a script does after its training loop is never lost to a migration: the spare that took a
slot runs the script's remaining code like any rank. Here rank 0 saves the final weights after the
loop (`examples/train_dp.py --save`); it is killed in one run and drained in another, and the file
saved must be bitwise equal to the one a run that never failed saves. (Before, the spare that took
slot 0 was stopped when the job ended, before its code after the loop ran: no file, and a green
result.)"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from temporalio.client import Client

from job_agent import wire
from job_agent.coordinator.jobs import request, wait_until_ready
from tests.integration.conftest import run_with, spec, start_job
from torchpass.job import JobResult
from torchpass.models import Disposition

pytestmark = pytest.mark.integration
ARGS = ("--steps", "120", "--width", "128", "--depth", "2")


def saving(tmp_path: Path, name: str) -> tuple[Path, Path]:
    """The run's state directory and the file its rank 0 saves after the loop."""
    run = tmp_path / name
    run.mkdir()
    return run, run / "final.pt"


def assert_same_weights(saved: Path, reference: Path) -> None:
    assert saved.exists(), "rank 0's code after the loop never ran"
    mine, theirs = torch.load(saved), torch.load(reference)
    assert mine.keys() == theirs.keys()
    for name, t in mine.items():
        assert t.dtype == theirs[name].dtype and t.shape == theirs[name].shape, name
        assert t.view(torch.uint8).equal(theirs[name].view(torch.uint8)), name


@pytest.fixture(scope="module")
async def reference_save(
    client: Client, tmp_path_factory: pytest.TempPathFactory
) -> tuple[JobResult, Path]:
    run, saved = saving(tmp_path_factory.mktemp("ref"), "ref")
    job = spec(run, "after-loop-reference", spares=0, args=(*ARGS, "--save", str(saved)))
    result = await run_with(client, job)
    assert result.ok and not result.incidents, result
    return result, saved


def assert_migrated(result: JobResult, reference: JobResult) -> None:
    assert result.ok, result.error
    (o,) = result.incidents
    assert o.disposition is Disposition.MIGRATED and o.success and o.lost_slots == (0,), o
    assert result.final_digest == reference.final_digest


async def test_rank_0_killed_still_saves_the_final_model_after_the_loop(
    client: Client, reference_save: tuple[JobResult, Path], tmp_path: Path
) -> None:
    run, saved = saving(tmp_path, "killed")
    job = spec(run, "after-loop-kill-0", args=(*ARGS, "--save", str(saved)))
    result = await run_with(client, job, [("kill", 0, 30)])
    assert_migrated(result, reference_save[0])
    assert_same_weights(saved, reference_save[1])


async def test_rank_0_drained_still_saves_the_final_model_after_the_loop(
    client: Client, reference_save: tuple[JobResult, Path], tmp_path: Path
) -> None:
    run, saved = saving(tmp_path, "drained")
    job = spec(run, "after-loop-drain-0", args=(*ARGS, "--save", str(saved)))
    task = await start_job(client, job)
    try:
        await asyncio.to_thread(wait_until_ready, job.state_dir, job.job_id)
        reply = await asyncio.to_thread(request, job.state_dir, job.job_id, wire.Drain(slot=0))
        assert isinstance(reply, wire.Ok), reply
        result = await asyncio.wait_for(asyncio.shield(task), 150)
    finally:
        if not task.done():
            task.cancel()
    assert_migrated(result, reference_save[0])
    assert_same_weights(saved, reference_save[1])
