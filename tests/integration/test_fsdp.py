"""FSDP2 and HSDP under real failures (`examples/train_fsdp.py`, 4 ranks, gloo on CPU): the script's
device mesh re-made on every re-formed group, a lost rank's shard rebuilt from its replica in the
other replica group, and the final state (every shard's digest) bitwise equal to the same script
never failed. Where no replica is left (plain FSDP2, or both replicas of one HSDP shard lost) the
incident is the brief's "failures exceeding parallelism redundancy" and the job restarts from its
sharded checkpoint."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from temporalio.client import Client

from job_agent import wire
from job_agent.coordinator.jobs import request, wait_until_ready
from tests.integration.conftest import ROOT, run_with, spec, start_job
from tests.integration.test_live_migration import assert_migrated_live
from torchpass.incident.outcome import Disposition
from torchpass.job import JobResult, JobState

pytestmark = pytest.mark.integration

FSDP_SCRIPT = ROOT / "examples" / "train_fsdp.py"
HSDP = ("--steps", "50", "--replicas", "2")
FSDP = ("--steps", "50", "--replicas", "1")


async def _reference(client: Client, where: Path, job_id: str, args: tuple[str, ...]) -> JobResult:
    result = await run_with(client, spec(where, job_id, spares=0, script=FSDP_SCRIPT, args=args))
    assert result.ok and result.final_digest and not result.incidents, result.error
    return result


@pytest.fixture(scope="module")
async def hsdp_reference(client: Client, tmp_path_factory: pytest.TempPathFactory) -> JobResult:
    return await _reference(client, tmp_path_factory.mktemp("hsdp-ref"), "hsdp-reference", HSDP)


async def test_hsdp_survives_a_kill_and_a_hang_live_and_bitwise_exact(
    client: Client, hsdp_reference: JobResult, tmp_path: Path
) -> None:
    job = spec(tmp_path, "hsdp-kill-hang", script=FSDP_SCRIPT, args=HSDP)
    result = await run_with(client, job, [("kill", 3, 17), ("hang", 0, 33)])
    assert_migrated_live(result, hsdp_reference, 2)
    assert [o.lost_slots for o in result.incidents] == [(3,), (0,)]
    for o in result.incidents:  # each shard from its replica in the other replica group
        assert o.proof is not None and o.proof.donor_slot == {3: 1, 0: 2}[o.lost_slots[0]], o.proof


async def test_a_whole_replica_group_lost_is_migrated_live_each_shard_from_its_own_replica(
    client: Client, hsdp_reference: JobResult, tmp_path: Path
) -> None:
    """Ranks 0 and 1 (one replica group: a node, in the usual layout) killed at one step: two shards
    lost, each with a replica left in the other group. One recovery moves both, each receiver from
    its own shard's replica, and the proof holds each to its own donor's state."""
    job = spec(tmp_path, "hsdp-group", spares=2, script=FSDP_SCRIPT, args=HSDP)
    kills = [wire.Inject(action=wire.InjectAction.KILL, slot=s, after_step=23) for s in (0, 1)]
    result = await run_with(client, job, kills)
    assert result.ok, result.error
    (o,) = result.incidents
    assert o.disposition is Disposition.MIGRATED and o.success and set(o.lost_slots) == {0, 1}, o
    assert o.proof is not None and o.proof.donor_of == {0: 2, 1: 3} and o.proof.replans == 0, (
        o.proof
    )
    for r in o.proof.receivers:  # each holds what its own donor served, as each computed it
        assert r.installed_digest == o.proof.donor_digests[o.proof.donor_of[r.slot]]
    # two shards
    assert o.proof.receivers[0].installed_digest != o.proof.receivers[1].installed_digest
    assert o.steps_recomputed == 0 == result.steps_recomputed
    assert result.final_digest == hsdp_reference.final_digest


async def test_both_replicas_of_a_shard_lost_is_disqualified_and_restarts_from_the_checkpoint(
    client: Client, hsdp_reference: JobResult, tmp_path: Path
) -> None:
    """Ranks 1 and 3 hold the two replicas of shard 1: both killed at one step, no replica is left.
    The incident is disqualified with the brief's reason and the job restarts from its checkpoint
    (every rank's shard of it), ending bitwise equal with the steps done again counted."""
    job = spec(tmp_path, "hsdp-both", script=FSDP_SCRIPT, args=HSDP)
    kills = [wire.Inject(action=wire.InjectAction.KILL, slot=s, after_step=27) for s in (1, 3)]
    result = await run_with(client, job, kills)
    assert result.ok, result.error
    (o,) = result.incidents
    assert o.disposition is Disposition.FALLBACK_RESTART and not o.classification.qualifying, o
    assert "exceeding parallelism redundancy" in o.classification.reason, o.classification
    assert set(o.lost_slots) == {1, 3}
    # checkpoint every 20
    assert o.fallback is not None and o.fallback.restored_step == 19, o.fallback
    assert result.steps_recomputed == o.steps_recomputed > 0
    assert result.final_digest == hsdp_reference.final_digest


@pytest.mark.parametrize("action", ["kill", "hang"])
async def test_plain_fsdp_has_no_replica_so_a_kill_or_a_hang_restarts_from_the_checkpoint(
    client: Client, tmp_path: Path, action: str
) -> None:
    """FSDP2 on 4 ranks, each shard held once: a rank killed, or hung (fenced, then killed), leaves
    its shard with no replica. Disqualified as the brief's row says, restarted from the sharded
    checkpoint, and bitwise equal to the run never interrupted."""
    reference = await _reference(client, tmp_path / "ref", "fsdp-reference", FSDP)
    job = spec(tmp_path / "run", f"fsdp-{action}", script=FSDP_SCRIPT, args=FSDP)
    result = await run_with(client, job, [(action, 2, 25)])
    assert result.ok, result.error
    (o,) = result.incidents
    assert o.disposition is Disposition.FALLBACK_RESTART and not o.classification.qualifying, o
    assert "exceeding parallelism redundancy" in o.classification.reason
    assert result.final_digest == reference.final_digest


async def test_plain_fsdp_moves_live_on_a_drain_the_leaving_rank_gives_its_own_shard(
    client: Client, tmp_path: Path
) -> None:
    """No replica of any shard, and yet a planned move is live: rank 2 is drained while healthy,
    freezes with the others, serves its own shard to the spare taking its slot, and only then goes.
    The proof names rank 2 as its own donor, and the run ends bitwise equal to the same script never
    drained."""
    args = ("--steps", "150", "--replicas", "1")
    job = spec(tmp_path / "run", "fsdp-drain", script=FSDP_SCRIPT, args=args)
    task = await start_job(client, job)
    try:
        await asyncio.to_thread(wait_until_ready, job.state_dir, job.job_id)
        reply = await asyncio.to_thread(request, job.state_dir, job.job_id, wire.Drain(slot=2))
        assert isinstance(reply, wire.Ok), reply
        result = await asyncio.wait_for(asyncio.shield(task), 150)
    finally:
        if not task.done():
            task.cancel()
    reference = await _reference(client, tmp_path / "ref", "fsdp-drain-reference", args)
    assert result.ok, result.error
    (o,) = result.incidents
    assert o.disposition is Disposition.MIGRATED and o.success and o.classification.qualifying, o
    assert o.lost_slots == (2,) and o.proof is not None and o.proof.donor_of == {2: 2}, o.proof
    assert o.steps_recomputed == 0 == result.steps_recomputed
    assert result.final_digest == reference.final_digest


async def test_uneven_sharding_is_refused_at_track(client: Client, tmp_path: Path) -> None:
    """A width of 30 over 4 shards: a spare could not hold every shard, so `track()` refuses, and
    the job ends as a user error that says why, before training."""
    job = spec(tmp_path, "fsdp-uneven", spares=0, script=FSDP_SCRIPT, args=(*FSDP, "--width", "30"))
    result = await run_with(client, job)
    assert result.status is JobState.USER_ERROR and result.error, result
    assert "unevenly over 4 ranks" in result.error and "before training" in result.error, (
        result.error
    )
