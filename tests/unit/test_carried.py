"""Per-rank state a script carries across steps (`job_agent.rank.state.Carried`, declared with
`RankAgent.carry`): a step done again starts from its value as the step began, whatever the failed
try did to it (advanced a prefetched batch, replaced a hidden state, changed a tensor in place); and
the coordinator's rejoin says which ranks started it afresh (`carried_lost`)."""

from __future__ import annotations

import torch

from job_agent import wire
from job_agent.coordinator.incident.executor import carried_lost
from job_agent.coordinator.members import Member
from job_agent.rank.state import Carried, StepBuffers
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
