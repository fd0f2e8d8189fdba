"""The loop form (`for step in agent.steps(N, data=loader): with step: ...`) under real failures: a
`DataLoader` over a `DistributedSampler` and an LR scheduler (`examples/train_loop.py`), real ranks
killed and hung, each migrated live, and the final state bitwise equal to the same script never
failed: the spare that takes a rank over reads the very batches the lost rank would have read."""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.client import Client

from tests.integration.conftest import ROOT, run_with, spec
from tests.integration.test_live_migration import assert_migrated_live
from torchpass.job import JobResult

pytestmark = pytest.mark.integration

LOOP = ROOT / "examples" / "train_loop.py"
# 1,024 samples over 4 ranks in batches of 16: 16 steps an epoch, so the run crosses epochs and a
# spare joins mid-epoch.
ARGS = ("--steps", "60", "--width", "64", "--depth", "2")


@pytest.fixture(scope="module")
async def loop_reference(client: Client, tmp_path_factory: pytest.TempPathFactory) -> JobResult:
    job = spec(
        tmp_path_factory.mktemp("loop-ref"), "loop-reference", spares=0, script=LOOP, args=ARGS
    )
    result = await run_with(client, job)
    assert result.ok and result.final_digest and not result.incidents, result.error
    return result


async def test_a_kill_and_a_hang_in_the_loop_form_are_migrated_live_and_bitwise_exact(
    client: Client, loop_reference: JobResult, tmp_path: Path
) -> None:
    job = spec(tmp_path, "loop-kill-hang", script=LOOP, args=ARGS)
    result = await run_with(client, job, [("kill", 2, 21), ("hang", 1, 40)])
    assert_migrated_live(result, loop_reference, 2)
    assert [o.lost_slots for o in result.incidents] == [(2,), (1,)]


async def test_a_different_data_order_is_not_bitwise_equal(
    client: Client, loop_reference: JobResult, tmp_path: Path
) -> None:
    """The comparison above can fail: the same script with one more sample per epoch (so other
    batches) ends with other bits."""
    job = spec(tmp_path, "loop-other", spares=0, script=LOOP, args=(*ARGS, "--samples", "1040"))
    result = await run_with(client, job)
    assert result.ok and result.final_digest != loop_reference.final_digest


async def test_a_break_ends_the_job_after_that_step(client: Client, tmp_path: Path) -> None:
    """Early stopping: a `break` after step 30 finishes the job there, in the state of a run of 31
    steps."""
    short = (*ARGS[2:], "--steps", "31")
    stopped = spec(
        tmp_path / "a", "loop-break", spares=0, script=LOOP, args=(*ARGS, "--stop-at", "30")
    )
    result = await run_with(client, stopped)
    assert result.ok and result.steps_completed == 31, result.error
    plain = await run_with(
        client, spec(tmp_path / "b", "loop-31", spares=0, script=LOOP, args=short)
    )
    assert plain.ok and result.final_digest == plain.final_digest
