"""Per-rank state a script carries across steps (`job_agent.rank.state.Carried`, declared with
`RankAgent.carry`): a step done again starts from its value as the step began, whatever the failed
try did to it (advanced a prefetched batch, replaced a hidden state, changed a tensor in place); and
the coordinator's rejoin says which ranks started it afresh (`carried_lost`)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from job_agent import wire
from job_agent.coordinator.incident.exactness import carried_lost, inexact, verdicts
from job_agent.coordinator.members import Member, Roster
from job_agent.coordinator.waiting import Changes
from job_agent.rank.state import Carried, StepBuffers
from job_agent.wire.operator import MemberState
from job_agent.wire.rank import Role
from tests.workflows.fake_job import proof_of


def test_a_step_done_again_starts_from_the_carried_value_as_the_step_began() -> None:
    buffers = StepBuffers(torch.nn.Linear(2, 2))
    hidden = Carried("hidden", (torch.zeros(3), [torch.ones(2)]))
    prefetched = Carried("batch", {"x": torch.arange(4)})
    buffers.carried += [hidden, prefetched]
    buffers.keep()
    hidden.value[0].add_(5)  # in place
    hidden.value = (torch.full((3,), 7.0), [torch.zeros(2)])  # replaced
    prefetched.value = {"x": torch.arange(4) + 100}  # the next batch drawn ahead
    buffers.restore()
    assert torch.equal(hidden.value[0], torch.zeros(3))
    assert torch.equal(hidden.value[1][0], torch.ones(2))
    assert torch.equal(prefetched.value["x"], torch.arange(4))
    prefetched.value["x"].add_(1)  # what the redone step does cannot reach what was kept
    buffers.restore()
    assert torch.equal(prefetched.value["x"], torch.arange(4))


def _member(slot: int, carried: tuple[str, ...]) -> Member:
    m = Member.__new__(Member)
    m.slot = slot
    m.layout = wire.ShardLayout(shard="s", carried=carried)
    return m


def test_the_rejoin_names_the_ranks_that_started_their_carried_state_afresh() -> None:
    proof = proof_of()  # rank 2 received the state
    assert carried_lost([_member(s, ()) for s in range(4)], proof) is None
    ranks = [_member(s, ("hidden",)) for s in range(4)]
    why = carried_lost(ranks, proof)
    assert why is not None and "rank(s) [2]" in why and "(hidden)" in why
    assert carried_lost(ranks, None) is None  # nothing moved: nothing started afresh


def _roster(ranks: list[Member]) -> Roster:
    roster = Roster()
    for m in ranks:
        m.agent_id, m.role, m.fenced, m.leaving = f"a{m.slot}", Role.RANK, False, False
        m.state = MemberState.TRAINING
        m.redo = m.redone = None
        roster.members[m.agent_id] = m
    return roster


def test_undeclared_state_seen_on_a_replaced_rank_makes_the_recovery_inexact() -> None:
    proof = proof_of()  # rank 2 received the state
    roster = _roster([_member(s, ()) for s in range(4)])
    assert inexact(roster, proof, resume=7) is None
    roster.carries[1] = "rank 1 fed its model ..."  # a survivor carries it: its own, kept
    assert inexact(roster, proof, resume=7) is None
    roster.carries[2] = "rank 2 fed its model at step 1 a tensor its forward returned"
    why = inexact(roster, proof, resume=7)
    assert why and "rank(s) [2] carried state" in why and "not told of" in why, why
    assert "agent.carry" in why


def test_a_step_redone_from_other_inputs_makes_the_recovery_inexact() -> None:
    ranks = [_member(s, ()) for s in range(4)]
    roster = _roster(ranks)
    ranks[0].redo, ranks[3].redo = 7, 7
    ranks[0].redone = wire.Redone(k=7, checked=True)
    ranks[3].redone = wire.Redone(k=6, checked=True, differs="rank 3 did step 6 again ...")
    assert inexact(roster, None, resume=7) is None  # an earlier step's verdict is not this one's
    ranks[3].redone = wire.Redone(k=7, checked=True, differs="rank 3 did step 7 again from other")
    why = inexact(roster, None, resume=7)
    assert why and why.startswith("rank 3 did step 7 again") and "agent.steps(data=" in why, why


async def test_the_recovery_waits_for_the_verdicts_of_the_ranks_redoing_its_step_only() -> None:
    """Bounded, and not at all for a rank frozen again (a peer lost in the redone step: the next
    recovery's), lost, or past the step."""
    ranks = [_member(s, ()) for s in range(3)]
    _roster(ranks)
    for m in ranks:
        m.redo, m.step = 7, 7
    ranks[0].redone = wire.Redone(k=7, checked=True)
    ranks[1].state = MemberState.FROZEN
    ranks[2].step = 8
    t0 = time.monotonic()
    await asyncio.wait_for(verdicts(Changes(), ranks, resume=7), timeout=5)
    assert time.monotonic() - t0 < 1
    ranks[1].state = MemberState.TRAINING  # a verdict still to come: waited for
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(verdicts(Changes(), ranks, resume=7), timeout=0.5)
