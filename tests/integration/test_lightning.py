"""Lightning's `Trainer` under the agent (`job_agent.frameworks.lightning_trainer.LiveDDPStrategy`,
`examples/train_lightning.py`): its own loop, DDP, AdamW with a per-step cosine schedule, dropout,
a DistributedSampler it injects, checkpoints every 10 steps. A kill and a hang are migrated live,
bitwise the run that never failed, with the model saved after training; with no spare, the job
restarts from Lightning's own latest checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from temporalio.client import Client

from tests.integration.conftest import ROOT, run_with, spec
from torchpass.job import JobResult, JobSpec
from torchpass.models import Disposition

pytestmark = pytest.mark.integration
SCRIPT = ROOT / "examples" / "train_lightning.py"
STEPS = 40


def pl_job(where: Path, name: str, spares: int = 1) -> JobSpec:
    args = ("--steps", str(STEPS), "--out", str(where / "out"), "--final", str(where / "final.pt"))
    return spec(where, name, spares=spares, script=SCRIPT, args=args, nproc=2)


def assert_same_model(where: Path, reference: Path) -> None:
    mine = torch.load(where / "final.pt", weights_only=True)
    theirs = torch.load(reference / "final.pt", weights_only=True)
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)


@pytest.fixture(scope="module")
async def reference(
    client: Client, tmp_path_factory: pytest.TempPathFactory
) -> tuple[JobResult, Path]:
    where = tmp_path_factory.mktemp("pl-ref")
    result = await run_with(client, pl_job(where, "pl-ref", spares=0), timeout=240)
    assert result.ok and result.final_digest and not result.incidents, result.error
    assert result.steps_completed == STEPS
    return result, where


async def test_a_kill_and_a_hang_are_migrated_live_and_bitwise(
    client: Client, reference: tuple[JobResult, Path], tmp_path: Path
) -> None:
    result = await run_with(
        client, pl_job(tmp_path, "pl-kill-hang"), [("kill", 1, 8), ("hang", 0, 27)], timeout=240
    )
    assert result.ok, result.error
    assert len(result.incidents) == 2, result.incidents
    for o in result.incidents:
        assert o.success and o.error is None, (o.error, o.disposition)
    assert result.final_digest == reference[0].final_digest
    assert_same_model(tmp_path, reference[1])


async def test_with_no_spare_the_job_resumes_from_lightnings_own_checkpoint(
    client: Client, reference: tuple[JobResult, Path], tmp_path: Path
) -> None:
    """Checkpoints every 10 steps: a rank killed in step 15 restarts the job from the one saved
    after step 9, which Lightning restores itself; steps 10 to 15 are done again, and counted."""
    result = await run_with(
        client, pl_job(tmp_path, "pl-fallback", spares=0), [("kill", 1, 15)], timeout=240
    )
    assert result.ok, result.error
    (o,) = result.incidents
    assert o.disposition is Disposition.FALLBACK_RESTART, o
    assert 5 <= o.steps_recomputed <= 7, o
    assert result.final_digest == reference[0].final_digest
    assert_same_model(tmp_path, reference[1])
