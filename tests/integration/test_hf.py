"""Hugging Face's `Trainer` under the agent (`job_agent.frameworks.hf.LiveTrainer`,
`examples/train_hf.py`): a tiny GPT-2 trained by the Trainer's own loop, with gradient
accumulation, a cosine schedule with warm-up, dropout, `save_strategy` checkpoints and a final
`save_model`. A kill and a hang of a rank are migrated live, and the run ends bitwise where the run
that never failed does, its final model saved; with no spare, the job restarts from the Trainer's
own latest checkpoint."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from temporalio.client import Client

from job_agent import wire
from job_agent.coordinator.jobs import request, wait_until_ready
from tests.integration.conftest import ROOT, run_with, spec, start_job
from torchpass.job import JobResult, JobSpec
from torchpass.models import Disposition

pytestmark = pytest.mark.integration
SCRIPT = ROOT / "examples" / "train_hf.py"
BETWEEN = ROOT / "tests" / "integration" / "hf_lost_between_steps.py"
STEPS = 30


def hf_job(where: Path, name: str, spares: int = 1, bf16: bool = False) -> JobSpec:
    args: tuple[str, ...] = ("--steps", str(STEPS), "--out", str(where / "out"))
    args += ("--final", str(where / "final"), *("--bf16",) * bf16)
    return spec(where, name, spares=spares, script=SCRIPT, args=args, nproc=2)


def assert_same_model(where: Path, reference: Path) -> None:
    """The model `save_model` wrote after training, bitwise the reference's."""
    mine = load_file(where / "final" / "model.safetensors")
    theirs = load_file(reference / "final" / "model.safetensors")
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)


@pytest.fixture(scope="module")
async def reference(
    client: Client, tmp_path_factory: pytest.TempPathFactory
) -> tuple[JobResult, Path]:
    where = tmp_path_factory.mktemp("hf-ref")
    result = await run_with(client, hf_job(where, "hf-ref", spares=0), timeout=240)
    assert result.ok and result.final_digest and not result.incidents, result.error
    return result, where


async def test_the_trainer_runs_under_the_agent(reference: tuple[JobResult, Path]) -> None:
    result, where = reference
    assert result.steps_completed == STEPS
    assert (where / "final" / "model.safetensors").exists()


async def test_a_kill_and_a_hang_are_migrated_live_and_bitwise(
    client: Client, reference: tuple[JobResult, Path], tmp_path: Path
) -> None:
    result = await run_with(
        client, hf_job(tmp_path, "hf-kill-hang"), [("kill", 1, 8), ("hang", 0, 19)], timeout=240
    )
    assert result.ok, result.error
    assert len(result.incidents) == 2, result.incidents
    for o in result.incidents:
        assert o.success and o.error is None, o
    assert result.final_digest == reference[0].final_digest
    assert_same_model(tmp_path, reference[1])


async def test_a_drained_rank_is_moved_live_and_bitwise(
    client: Client, reference: tuple[JobResult, Path], tmp_path: Path
) -> None:
    job = hf_job(tmp_path, "hf-drain")
    task = await start_job(client, job)
    try:
        await asyncio.to_thread(wait_until_ready, job.state_dir, job.job_id)
        reply = await asyncio.to_thread(request, job.state_dir, job.job_id, wire.Drain(slot=0))
        assert isinstance(reply, wire.Ok), reply
        result = await asyncio.wait_for(asyncio.shield(task), 240)
    finally:
        if not task.done():
            task.cancel()
    assert result.ok, result.error
    (o,) = result.incidents
    assert o.disposition is Disposition.MIGRATED and o.success, o
    assert result.final_digest == reference[0].final_digest
    assert_same_model(tmp_path, reference[1])


async def test_with_no_spare_the_job_resumes_from_the_trainers_own_checkpoint(
    client: Client, reference: tuple[JobResult, Path], tmp_path: Path
) -> None:
    """`save_steps=10`: a rank killed in step 15 restarts the job from `checkpoint-10` (10 steps
    done), which the Trainer loads itself; steps 10 to 15 are done again, and counted."""
    result = await run_with(
        client, hf_job(tmp_path, "hf-fallback", spares=0), [("kill", 1, 15)], timeout=240
    )
    assert result.ok, result.error
    (o,) = result.incidents
    assert o.disposition is Disposition.FALLBACK_RESTART, o
    assert 5 <= o.steps_recomputed <= 7, o  # from step 10, not from step 0
    assert result.final_digest == reference[0].final_digest
    assert_same_model(tmp_path, reference[1])


async def test_mixed_precision_a_kill_is_migrated_live_and_bitwise(
    client: Client, tmp_path: Path
) -> None:
    """bfloat16 autocast (`bf16=True`), the Trainer's mixed precision on the CPU."""
    ref = await run_with(
        client, hf_job(tmp_path / "ref", "hf-bf16-ref", spares=0, bf16=True), timeout=240
    )
    assert ref.ok and ref.final_digest, ref.error
    result = await run_with(
        client, hf_job(tmp_path / "run", "hf-bf16", bf16=True), [("kill", 0, 12)], timeout=240
    )
    assert result.ok, result.error
    (o,) = result.incidents
    assert o.success, o
    assert result.final_digest == ref.final_digest
    assert_same_model(tmp_path / "run", tmp_path / "ref")


async def test_a_peer_lost_while_the_trainer_logs_between_steps_costs_that_log_only(
    client: Client, reference: tuple[JobResult, Path], tmp_path: Path
) -> None:
    """Rank 1 dies as step 9 ends; rank 0 is lost in the loss gather of the logging at step 10:
    the spare takes rank 1's slot at step 10, that log line is skipped, training goes on bitwise."""
    job = hf_job(tmp_path, "hf-between").model_copy(update={"script": BETWEEN})
    result = await run_with(client, job, timeout=240)
    assert result.ok, result.error
    (o,) = result.incidents
    assert o.disposition is Disposition.MIGRATED and o.success, o
    assert result.final_digest == reference[0].final_digest
    assert_same_model(tmp_path, reference[1])
