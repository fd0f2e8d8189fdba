"""Planned moves (a drain, a cordon, a GPU warming up): the leaving ranks give their own state.

The real Coordinator and IncidentSteps against in-process fake ranks over the real protocol
(`job_driver`). A rank a planned move takes off its node is healthy: it freezes with the others,
leaves the world (its slot goes to a spare) and stays alive until its state has moved, each the
donor of its own shard. So a shard with no replica (plain FSDP2; here the fakes' `sharded`) moves
live too, and only a failed rank needs a replica.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from job_agent import wire
from job_agent.coordinator.jobs import request
from tests.unit.fake_ranks import KILLED
from tests.unit.job_driver import Counts, Job, Migration, until
from torchpass.errors import ErrorType
from torchpass.incident.steps import IncidentRef, TransferResult
from torchpass.models import Category, Disposition


async def _drain(job: Job, slot: int) -> None:
    reply = await asyncio.to_thread(
        request, job.spec.state_dir, job.spec.job_id, wire.Drain(slot=slot)
    )
    assert isinstance(reply, wire.Ok), reply


def _watch_transfer(job: Job, during: Callable[[], None]) -> None:
    """Call `during()` as the transfer step starts (the leaving ranks have frozen and left the
    world)."""
    transfer = job.steps.transfer

    async def watched(ref: IncidentRef, tick: Callable[[int], None]) -> TransferResult:
        during()
        return await transfer(ref, tick)

    job.steps.transfer = watched  # type: ignore[method-assign]


async def test_a_drained_rank_gives_its_own_state_then_goes(
    tmp_path: Path, allowance: Counts
) -> None:
    """Data parallel, rank 2 drained: it is not fenced at confirm, freezes, stays alive through the
    transfer as the donor of its own slot, and is fenced once the state has moved; the spare takes
    slot 2 with the leaving rank's bytes, checked by the proof, and nothing is recomputed."""
    job = Job(tmp_path, allowance, nproc=4)
    job.launcher.step_seconds = 0.1  # still training when the drain comes
    async with job:
        await _drain(job, 2)
        workflow_id, report = await job.report()
        leaving = job.coordinator.roster.at(2)
        assert leaving is not None
        alive_at_transfer: list[int | None] = []
        _watch_transfer(job, lambda: alive_at_transfer.append(job.launcher.poll(leaving.agent_id)))
        m = Migration(job, workflow_id, report)
        outcome = await m.run()
        cf, fr, tr = m.confirmed, m.frozen, m.transferred
        assert cf is not None and fr is not None and tr is not None, m.failed
        assert cf.lost_slots == cf.leaving_slots == (2,) and cf.fenced_slots == ()
        assert alive_at_transfer == [None]  # frozen, out of the world, still running
        target = fr.target_step
        assert fr.leaving_steps == {2: target} and 2 not in fr.completed_steps
        p = tr.proof
        assert p.donor_of == {2: 2} and p.donor_slot == 2 and p.receiver_slots == (2,), p
        assert (
            outcome.disposition is Disposition.MIGRATED
            and outcome.success
            and outcome.steps_recomputed == 0
        )
        assert (
            outcome.classification.category is Category.PLANNED
            and outcome.classification.qualifying
        )
        assert job.launcher.poll(leaving.agent_id) == KILLED  # gone once its state moved
        holder = job.coordinator.roster.at(2)
        assert holder is not None and holder.agent_id != leaving.agent_id and not holder.leaving
        await job.finished()


async def test_a_shard_with_no_replica_moves_live_from_its_leaving_rank(
    tmp_path: Path, allowance: Counts
) -> None:
    """Each slot its own shard (plain FSDP2): a kill there is beyond redundancy, but a drain is not.
    The drained rank is the only holder of its shard and its only donor; the move is live and
    qualifying."""
    job = Job(tmp_path, allowance, nproc=4)
    job.launcher.sharded = True
    job.launcher.step_seconds = 0.1
    async with job:
        await _drain(job, 1)
        m = Migration(job, *await job.report())
        outcome = await m.run()
        assert (
            m.confirmed is not None
            and m.confirmed.redundancy == 1
            and m.confirmed.leaving_slots == (1,)
        )
        assert outcome.disposition is Disposition.MIGRATED and outcome.success, (outcome, m.failed)
        assert m.transferred is not None and m.transferred.proof.donor_of == {1: 1}
        assert m.transferred.proof.donor_shards == {1: "fake-shard-1"}
        await job.finished()


async def test_a_leaving_rank_lost_before_its_state_moved_leaves_its_shard_no_donor(
    tmp_path: Path, allowance: Counts
) -> None:
    """The drained rank of a shard with no replica dies after the freeze: nobody else holds its
    state, so the transfer fails (never a pass) and the job restarts from its checkpoint; nothing is
    left running."""
    job = Job(tmp_path, allowance, nproc=4, ckpt=4)
    job.launcher.sharded = True
    job.launcher.step_seconds = 0.1
    async with job:
        await _drain(job, 1)
        workflow_id, report = await job.report()
        leaving = job.coordinator.roster.at(1)
        assert leaving is not None
        _watch_transfer(job, lambda: job.launcher.kill(leaving.agent_id))
        m = Migration(job, workflow_id, report)
        outcome = await m.run()
        assert m.failed["transfer"].error_type is ErrorType.BEYOND_REDUNDANCY, m.failed
        assert "no healthy replica of rank 1's shard" in str(m.failed["transfer"])
        assert outcome.disposition is Disposition.FALLBACK_RESTART and m.fallback is not None
        await until(lambda: not job.coordinator.roster.departing(), "no leaving rank left")
        await job.finished()
