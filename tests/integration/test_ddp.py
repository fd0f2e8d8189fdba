"""Stock `DistributedDataParallel` under real failures (`examples/train_ddp.py`): the model wrapped as
usual, a default `DistributedSampler`, a cosine schedule and gradient accumulation with `no_sync()`. Real
ranks killed and hung, each migrated live (the wrapper moved onto the re-formed group, the spare's fresh
wrapper on the same bucket layout as its peers), and the final state bitwise equal to the same script never
failed."""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.client import Client

from tests.integration.conftest import ROOT, run_with, spec
from tests.integration.test_live_migration import assert_migrated_live
from torchpass.job import JobResult, JobState

pytestmark = pytest.mark.integration

DDP_SCRIPT = ROOT / "examples" / "train_ddp.py"
# 2,048 samples over 4 ranks in batches of 32: 16 steps an epoch; buckets of 50 kB, so the 3 x 128-wide
# layers reduce in several buckets.
ARGS = ("--steps", "50", "--width", "128", "--depth", "3")


@pytest.fixture(scope="module")
async def ddp_reference(client: Client, tmp_path_factory: pytest.TempPathFactory) -> JobResult:
    job = spec(tmp_path_factory.mktemp("ddp-ref"), "ddp-reference", spares=0, script=DDP_SCRIPT, args=ARGS)
    result = await run_with(client, job)
    assert result.ok and result.final_digest and not result.incidents, result.error
    return result


async def test_stock_ddp_survives_a_kill_and_a_hang_live_and_bitwise_exact(
    client: Client, ddp_reference: JobResult, tmp_path: Path
) -> None:
    job = spec(tmp_path, "ddp-kill-hang", script=DDP_SCRIPT, args=ARGS)
    result = await run_with(client, job, [("kill", 3, 17), ("hang", 1, 33)])
    assert_migrated_live(result, ddp_reference, 2)
    assert [o.lost_slots for o in result.incidents] == [(3,), (1,)]


async def test_other_accumulation_is_not_bitwise_equal(
    client: Client, ddp_reference: JobResult, tmp_path: Path
) -> None:
    """The comparison above can fail: the same script in 4 micro-batches instead of 2 ends with other bits."""
    job = spec(tmp_path, "ddp-other", spares=0, script=DDP_SCRIPT, args=(*ARGS, "--accum", "4"))
    result = await run_with(client, job)
    assert result.ok and result.final_digest != ddp_reference.final_digest


LOCAL_BUFFERS = ROOT / "tests" / "integration" / "ddp_local_buffers.py"


async def test_batchnorm_statistics_are_rank_0s_at_every_step_boundary_so_rank_0_can_be_lost(
    client: Client, tmp_path: Path
) -> None:
    """A BatchNorm's running statistics change in the forward, before the collective, and DDP gives every
    rank rank 0's only at the next forward. The agent rewinds them when a step is done again and gives every
    rank rank 0's as each step ends, so losing rank 0 itself is still bitwise exact."""
    args = ("--broadcast-buffers",)
    ref = spec(tmp_path / "ref", "ddp-bn-ref", spares=0, script=LOCAL_BUFFERS, args=args)
    reference = await run_with(client, ref)
    assert reference.ok and reference.final_digest, reference.error
    job = spec(tmp_path / "kill", "ddp-bn-kill", script=LOCAL_BUFFERS, args=args)
    result = await run_with(client, job, [("kill", 0, 9), ("kill", 2, 20)])
    assert_migrated_live(result, reference, 2)


async def test_ddp_keeping_each_ranks_buffers_is_refused_at_track(client: Client, tmp_path: Path) -> None:
    """`broadcast_buffers=False` with a BatchNorm leaves every replica its own statistics, which no spare
    could take over: `track()` refuses it with the reason, and the job fails at once, naming it."""
    job = spec(tmp_path, "ddp-local-buffers", spares=0, script=LOCAL_BUFFERS, args=())
    result = await run_with(client, job, timeout=60)
    assert result.status is JobState.USER_ERROR and result.error, result.error
    assert "before training" in result.error and "broadcast_buffers=False" in result.error, result.error
