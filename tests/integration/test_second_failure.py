"""A second failure in the middle of a recovery: the donor, the spare receiving the state or another
rank killed (or hung) while the state moves. Real ranks, real SIGKILLs, the real server and
workflows.

The recovery folds the second loss into the incident and re-plans (another donor, the next spare);
the migration completes live, nothing is recomputed, the final state is bitwise equal to the run
never failed, and both failures are on the incident's record. Before re-planning each of these ended
in a checkpoint restart after 30-44 s with 5 steps recomputed, and the second failure was recorded
nowhere.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
from temporalio.client import Client

from job_agent import wire
from job_agent.coordinator.incident.executor import IncidentSteps
from tests.integration.conftest import run_with, spec
from tests.integration.test_live_migration import assert_migrated_live
from torchpass.job import JobResult

pytestmark = pytest.mark.integration
# How long the job's incident steps give a transfer (IncidentSteps' default, as `torchpass run`
# makes them): what a silent donor or receiver cost before a stopped process was a loss of the
# recovery.
TRANSFER_TIMEOUT: float = (
    inspect.signature(IncidentSteps).parameters["transfer_timeout"].default.total_seconds()
)


def during_transfer(action: str, target: str, slot: int = 0) -> wire.Inject:
    return wire.Inject(
        action=wire.InjectAction(action),
        slot=slot,
        during="transfer",
        target=wire.InjectTarget(target),
    )


async def _one_incident_two_losses(result: JobResult, reference: JobResult) -> None:
    assert_migrated_live(result, reference, 1)
    (o,) = result.incidents
    assert o.proof is not None and o.proof.replans >= 1, o.proof
    # Both failures are on the record: two reports at least, a later loss among the lost slots.
    assert o.evidence_count >= 2, o
    assert set(o.proof.lost_during) <= set(o.lost_slots), o


async def test_the_donor_killed_mid_transfer_is_replaced_by_another_replica(
    client: Client, reference: JobResult, tmp_path: Path
) -> None:
    job = spec(tmp_path, "donor-killed", spares=2)
    result = await run_with(client, job, [during_transfer("kill", "donor"), ("kill", 2, 20)])
    await _one_incident_two_losses(result, reference)
    (o,) = result.incidents
    assert o.proof is not None
    # Rank 0 was the first donor (the lowest replica at the frozen step); killed as the transfer
    # began, it may still have served slot 2 (what arrived whole and verified before it died stays),
    # and rank 1 served the rest: both lost slots (the first failure's and the donor's) took a spare
    # with the state.
    assert set(o.proof.receiver_slots) == {0, 2}, o.proof
    assert o.proof.donor_of[0] == 1 and o.proof.donor_of[2] in (0, 1), o.proof
    assert o.lost_slots == (0, 2) and o.proof.lost_during == (0,)


async def test_the_spare_killed_while_receiving_is_replaced_by_the_next_spare(
    client: Client, reference: JobResult, tmp_path: Path
) -> None:
    job = spec(tmp_path, "spare-killed", spares=2)
    result = await run_with(client, job, [during_transfer("kill", "receiver"), ("kill", 1, 20)])
    await _one_incident_two_losses(result, reference)
    (o,) = result.incidents
    # The receiver was a spare in slot 1's place: slot 1 was lost already; the next spare took it.
    assert o.proof is not None and o.proof.receiver_slots == (1,) and o.lost_slots == (1,), o.proof


async def test_another_rank_killed_during_the_transfer_folds_into_the_same_incident(
    client: Client, reference: JobResult, tmp_path: Path
) -> None:
    job = spec(tmp_path, "double-kill", spares=2)
    result = await run_with(client, job, [during_transfer("kill", "rank", slot=3), ("kill", 1, 20)])
    await _one_incident_two_losses(result, reference)
    (o,) = result.incidents
    assert o.proof is not None and set(o.proof.receiver_slots) == {1, 3}, o.proof
    assert o.lost_slots == (1, 3) and o.proof.lost_during == (3,)


@pytest.mark.parametrize("target", ["donor", "receiver"])
async def test_a_process_stopped_mid_transfer_is_a_loss_of_the_recovery_not_a_timeout(
    client: Client, reference: JobResult, tmp_path: Path, target: str
) -> None:
    """The donor, or the spare receiving the state, SIGSTOPped as the transfer starts: alive, its
    socket open, silent. Past the hang timeout it is one more loss of the recovery (hang evidence,
    killed), and the plan is re-made at once. On the previous main the transfer waited out its 120 s
    timeout and the incident fell back to a checkpoint restart."""
    job = spec(tmp_path, f"{target}-stopped", spares=2)
    result = await run_with(client, job, [during_transfer("hang", target), ("kill", 1, 20)])
    await _one_incident_two_losses(result, reference)
    (o,) = result.incidents
    # Liveness, not speed: re-planned past the hang timeout, not after waiting out the transfer's
    # own.
    assert o.recovery_seconds is not None and o.recovery_seconds < TRANSFER_TIMEOUT / 4, (
        o.recovery_seconds
    )


async def test_a_rank_killed_as_the_group_re_forms_is_supplied_and_the_group_formed_again(
    client: Client, reference: JobResult, tmp_path: Path
) -> None:
    """The state has moved and the group begins to form when a survivor dies: the others were
    blocked forming a group that could never form, until the store's 60 s timeout killed every one
    of them (the whole world lost, a checkpoint restart: the fallbacks of the 1,000-failure chaos
    run). Now the job abandons that generation, so the others give up at once and freeze again; the
    lost slot gets the next spare and the state, and the group forms without it, live."""
    job = spec(tmp_path, "regroup-kill", spares=2)
    at_regroup = wire.Inject(action=wire.InjectAction.KILL, slot=3, after_step=19, during="regroup")
    result = await run_with(client, job, [at_regroup, ("kill", 1, 20)])
    await _one_incident_two_losses(result, reference)
    (o,) = result.incidents
    assert o.proof is not None and set(o.proof.receiver_slots) == {1, 3}, o.proof
    assert o.lost_slots == (1, 3) and o.proof.lost_during == (3,)
    # Liveness, not speed: the others gave up on the abandoned generation, not at the store's
    # timeout (the group's, the job's collective timeout), which killed them all before.
    assert o.recovery_seconds is not None and o.recovery_seconds < job.collective_timeout / 2, o


async def test_a_rank_killed_as_the_first_group_forms_is_migrated_live(
    client: Client, reference: JobResult, tmp_path: Path
) -> None:
    """Rank 2 dies just as generation 0 begins to form: the others wait for it in
    init_process_group, a group that can never form. The incident abandons that generation, so they
    give up at once, freeze at the state they built, and the spare takes the slot with it: live, not
    a 60 s store timeout."""
    job = spec(tmp_path, "first-group-kill")
    at_start = wire.Inject(action=wire.InjectAction.KILL, slot=2, during="regroup")
    result = await run_with(client, job, [at_start])
    assert_migrated_live(result, reference, 1)
    (o,) = result.incidents
    # Liveness, not speed: the others gave up on the abandoned generation, not at the store's
    # timeout.
    assert o.lost_slots == (2,) and o.recovery_seconds is not None, o
    assert o.recovery_seconds < job.collective_timeout / 2, o
