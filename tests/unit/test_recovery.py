"""The coordinator's pure decisions: hang detection and donor choice."""

from __future__ import annotations

import pytest

from job_agent.coordinator.detect.hangs import Progress, find_hung
from job_agent.coordinator.incident.donors import choose_donor, receivers


def test_a_silent_rank_is_hung() -> None:
    ranks = [Progress(0, 10.0), Progress(1, 7.0)]
    assert [h.slot for h in find_hung(ranks, now=10.0, timeout=2.0)] == [1]


def test_a_rank_that_never_enters_the_collective_its_peers_wait_in_is_hung() -> None:
    ranks = [Progress(0, 10.0, 5, 6.0), Progress(1, 10.0, 5, 6.5), Progress(2, 10.0, 4, 5.0)]
    hung = find_hung(ranks, now=10.0, timeout=2.0)
    assert [h.slot for h in hung] == [2]
    assert "step 5" in hung[0].detail


def test_a_rank_that_said_it_is_busy_or_is_in_its_first_step_is_late_not_hung() -> None:
    """Rank 2 evaluates alone (`agent.busy`), or has not reached its first collective since it
    joined (a cold start): its peers waiting long for it is no hang; silence still is."""
    busy = [
        Progress(0, 10.0, 5, 6.0),
        Progress(1, 10.0, 5, 6.5),
        Progress(2, 10.0, 4, 5.0, excused=True),
    ]
    assert find_hung(busy, now=10.0, timeout=2.0) == []
    stopped = [Progress(0, 10.0, 5, 6.0), Progress(2, 7.0, 4, 5.0, excused=True)]
    assert [h.slot for h in find_hung(stopped, now=10.0, timeout=2.0)] == [2]


def test_peers_that_only_just_started_waiting_are_not_a_hang() -> None:
    ranks = [Progress(0, 10.0, 5, 9.5), Progress(1, 10.0, 4, 9.0)]
    assert find_hung(ranks, now=10.0, timeout=2.0) == []


def test_ranks_in_step_are_healthy() -> None:
    ranks = [Progress(s, 10.0, 5, 1.0) for s in range(4)]
    assert find_hung(ranks, now=10.0, timeout=2.0) == []


def test_the_donor_is_the_most_advanced_survivor_lowest_slot_first() -> None:
    assert choose_donor({0: 9, 1: 10, 3: 10}) == (1, 10)
    assert choose_donor({2: 4, 3: 4}) == (2, 4)


def test_no_survivor_means_no_donor() -> None:
    with pytest.raises(ValueError):
        choose_donor({})


def test_receivers_are_the_newcomers_and_any_survivor_left_behind() -> None:
    assert receivers({0: 9, 1: 10, 3: 10}, 10, frozenset({2})) == [0, 2]
    assert receivers({0: 10, 1: 10}, 10, frozenset({2, 3})) == [2, 3]
