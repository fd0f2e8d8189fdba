"""Replicas that never were one state: a script whose ranks build their model from different seeds
(and reduce gradients with the agent, not DDP, so nothing starts them from rank 0's weights) is
refused as the job's group first forms, with the fix named in the job's result; seeded alike, the
same script runs. So is a random stream the script tracks but seeds per rank: a spare would take a
replica's position."""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.client import Client

from tests.integration.conftest import ROOT, run_with, spec
from torchpass.job import JobState

pytestmark = pytest.mark.integration

UNSEEDED = ROOT / "tests" / "integration" / "unseeded.py"


async def test_ranks_starting_from_different_weights_are_refused(
    client: Client, tmp_path: Path
) -> None:
    job = spec(tmp_path / "a", "unseeded", spares=0, script=UNSEEDED, args=())
    result = await run_with(client, job, timeout=90)
    assert result.status is JobState.USER_ERROR and result.error, result.error
    assert "started from another model state" in result.error and "seed the model" in result.error
    assert not result.incidents


async def test_ranks_seeded_alike_start_as_replicas(client: Client, tmp_path: Path) -> None:
    job = spec(tmp_path / "b", "seeded", spares=0, script=UNSEEDED, args=("--seeded",))
    result = await run_with(client, job, timeout=90)
    assert result.ok and result.final_digest, result.error


async def test_a_batch_fetched_ahead_of_its_step_is_refused_before_training(
    client: Client, tmp_path: Path
) -> None:
    """nanoGPT's shape: the first batch drawn before the loop, each next one in the step before its
    own. A spare taking a rank over at step k would use the batch it drew before its loop, not the
    one the lost rank drew in step k - 1: the run would end with other bits, every replica alike (no
    check sees it). The draw between track() and the first step gives it away: refused, naming the
    fix."""
    job = spec(
        tmp_path / "d", "prefetch", spares=0, script=UNSEEDED, args=("--seeded", "--prefetch")
    )
    result = await run_with(client, job, timeout=90)
    assert result.status is JobState.USER_ERROR and result.error, result.error
    assert "drew from torch's global random stream after agent.track()" in result.error, (
        result.error
    )
    assert "Draw each step's data inside that step" in result.error and not result.incidents


async def test_a_tracked_random_stream_seeded_per_rank_is_refused(
    client: Client, tmp_path: Path
) -> None:
    args = ("--seeded", "--stream-per-rank")
    job = spec(tmp_path / "c", "stream-per-rank", spares=0, script=UNSEEDED, args=args)
    result = await run_with(client, job, timeout=90)
    assert result.status is JobState.USER_ERROR and result.error, result.error
    assert "started from another random streams state" in result.error, result.error
    assert "draw from torch's" in result.error and not result.incidents
