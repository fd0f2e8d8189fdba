"""Taking a job back: which rejoined processes go on, which are fenced, and what the job reports
lost.

The roster, members and node bookkeeping are the real ones; the job around them is a record of what
was fenced (taking back a whole job over real processes is
`tests/integration/test_coordinator_restart.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from job_agent import wire
from job_agent.coordinator.members import Member, Roster
from job_agent.coordinator.takeback import _fence_stale, _lost_meanwhile
from torchpass.models import FailureKind


@dataclass
class _Job:
    job_id: str = "job"
    world_size: int = 3
    roster: Roster = field(default_factory=Roster)
    fenced: list[str] = field(default_factory=list)

    def fence(self, m: Member) -> None:
        m.fenced = True
        self.fenced.append(m.agent_id)


class _Nodes:
    def ended_in(self, slot: int) -> tuple[str, int | None]:
        return "node0", None


def _rank(job: _Job, agent: str, slot: int, generation: int | None, completed: int) -> Member:
    m = Member(agent, wire.Role.RANK, slot, 1, "node0", completed=completed)
    if generation is not None:
        m.joined = wire.Joined(generation=generation, completed=completed)
    job.roster.members[agent] = m
    return m


def test_a_rank_left_in_an_older_generation_is_fenced_and_its_slot_reported() -> None:
    job = _Job()
    _rank(job, "rank-0", 0, 2, 40)
    _rank(job, "rank-1", 1, 1, 30)  # missed the re-formation into generation 2
    _rank(job, "rank-2", 2, 2, 40)
    stale = _fence_stale(job, 2)  # type: ignore[arg-type]
    assert job.fenced == ["rank-1"] and set(stale) == {1}
    (ev,) = _lost_meanwhile(job, _Nodes(), stale)  # type: ignore[arg-type]
    assert (
        ev.slots == (1,) and ev.kind is FailureKind.CONNECTION_LOST and "generation 1" in ev.detail
    )


def test_of_two_processes_claiming_one_slot_the_one_furthest_along_stays_and_no_slot_is_lost() -> (
    None
):
    job = _Job()
    _rank(job, "rank-0", 0, 2, 40)
    _rank(job, "rank-1-old", 1, 2, 35)
    _rank(job, "rank-1", 1, 2, 40)
    _rank(job, "rank-2", 2, 2, 40)
    stale = _fence_stale(job, 2)  # type: ignore[arg-type]
    assert job.fenced == ["rank-1-old"] and stale == {}
    assert _lost_meanwhile(job, _Nodes(), stale) == []  # type: ignore[arg-type]


def test_ranks_that_never_joined_a_group_are_not_fenced() -> None:
    job = _Job()
    for slot in range(3):
        _rank(job, f"rank-{slot}", slot, None if slot else 0, -1)
    assert _fence_stale(job, 0) == {} and job.fenced == []  # type: ignore[arg-type]
