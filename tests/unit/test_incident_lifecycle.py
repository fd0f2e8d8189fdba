"""The job-side incident's lifecycle (`job_agent.coordinator.incident.lifecycle`): one state at a
time, moved by one function that refuses what the steps' order does not allow, and who drives it."""

from __future__ import annotations

import itertools

import pytest

from job_agent.coordinator.incident.lifecycle import (
    MOVES,
    Driver,
    IllegalTransition,
    Incident,
    IncidentState,
    transition,
)
from torchpass.errors import ErrorType

S, D = IncidentState, Driver

# The orders MigrationWorkflow (and the job's own recovery) take the steps in, each a legal walk.
LIVE = [S.FREEZING, S.FROZEN, S.MOVED, S.TRAINING, S.COMPLETED]
LOST_AFTER_THE_STATE_MOVED = [S.FREEZING, S.FROZEN, S.MOVED, S.MOVED, S.TRAINING, S.COMPLETED]
NO_SPARE = [S.RESTARTING, S.RESTARTED, S.COMPLETED]
TRANSFER_FAILED = [S.FREEZING, S.FROZEN, S.RESTARTING, S.RESTARTED, S.COMPLETED]
PROOF_FAILED_AFTER_REJOIN = [S.FREEZING, S.FROZEN, S.MOVED, S.TRAINING, S.RESTARTING, S.COMPLETED]
FREEZE_RETRIED = [S.FREEZING, S.FREEZING, S.FROZEN, S.MOVED, S.TRAINING, S.COMPLETED]
NOT_A_FAILURE = [S.COMPLETED]


@pytest.mark.parametrize(
    "walk",
    [
        LIVE,
        LOST_AFTER_THE_STATE_MOVED,
        NO_SPARE,
        TRANSFER_FAILED,
        PROOF_FAILED_AFTER_REJOIN,
        FREEZE_RETRIED,
    ],
)
def test_every_order_the_workflow_takes_is_a_legal_walk(walk: list[IncidentState]) -> None:
    inc = Incident("wf")
    for to in walk:
        inc.move(to)
    assert inc.state is walk[-1]


@pytest.mark.parametrize(
    ("walk", "illegal"),
    [
        ([], S.TRAINING),  # a rejoin before any freeze
        ([], S.MOVED),  # a transfer before the freeze
        ([S.FREEZING], S.TRAINING),  # a rejoin before the state moved
        ([S.FREEZING, S.FROZEN, S.MOVED, S.TRAINING], S.FREEZING),  # frozen again once training
        # a migration after the fallback restarted the job
        ([S.RESTARTING, S.RESTARTED], S.FREEZING),
        ([S.RESTARTING], S.MOVED),
        (NOT_A_FAILURE, S.FREEZING),  # any step after the outcome
        (LIVE, S.COMPLETED),  # recorded twice
        (NO_SPARE, S.RESTARTING),
    ],
)
def test_an_illegal_move_is_refused_typed_and_changes_nothing(
    walk: list[IncidentState], illegal: IncidentState
) -> None:
    inc = Incident("wf")
    for to in walk:
        inc.move(to)
    before = inc.state
    with pytest.raises(IllegalTransition) as refused:
        inc.move(illegal)
    assert refused.value.error_type is ErrorType.OUT_OF_ORDER and not refused.value.retryable
    assert f"no move from {before.value} to {illegal.value}" in str(refused.value)
    assert inc.state is before


def test_allows_refuses_a_step_before_it_does_any_work() -> None:
    inc = Incident("wf")
    with pytest.raises(IllegalTransition):
        inc.allows(S.TRAINING)
    assert inc.state is S.OPEN
    inc.allows(S.FREEZING)
    assert inc.state is S.OPEN  # asking moves nothing


def test_the_table_is_the_only_authority_and_covers_every_pair() -> None:
    """`transition` allows exactly the table's moves, for every pair of states and of drivers."""
    pairs = [*itertools.product(IncidentState, IncidentState), *itertools.product(Driver, Driver)]
    for a, b in pairs:
        allowed = b in MOVES[a]
        try:
            assert transition(a, b) is b  # type: ignore[type-var]
            assert allowed, f"{a} -> {b} allowed but not in the table"
        except IllegalTransition:
            assert not allowed, f"{a} -> {b} in the table but refused"
    assert MOVES[S.COMPLETED] == frozenset()  # nothing moves a recorded incident


def test_recovering_and_past_freeze_follow_the_state() -> None:
    inc = Incident("wf")
    assert not inc.past_freeze and not inc.recovering
    for to, recovering in [
        (S.FREEZING, True),
        (S.FROZEN, True),
        (S.MOVED, True),
        (S.TRAINING, False),
    ]:
        inc.move(to)
        assert inc.past_freeze and inc.recovering is recovering
    inc.move(S.COMPLETED)
    assert inc.past_freeze and not inc.recovering


def test_who_drives_it() -> None:
    """A workflow step makes it the workflow's; none in time makes it the job's, for good; a
    squatter's step, once the incident moves to a fresh id, counted for nothing."""
    inc = Incident("wf")
    inc.drive(D.WORKFLOW)
    inc.drive(D.WAITING)  # rekeyed
    inc.drive(D.JOB)
    with pytest.raises(IllegalTransition):
        inc.drive(D.WORKFLOW)  # a late workflow step never takes over what the job carried out
    with pytest.raises(IllegalTransition):
        inc.drive(D.WAITING)
    assert inc.driver is D.JOB
