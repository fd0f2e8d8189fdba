"""Many nodes lost at once is the brief's "switch / fabric-wide outage" (shared infrastructure,
disqualifying), not a run of host failures: `Detector.node_lost` over the job's own record of where
each slot ran (a stand-in roster answering `home(slot)`, the one thing it reads), then the real
classifier."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from job_agent.coordinator.clock import SimulatedClock
from job_agent.coordinator.detect.detection import FABRIC_WINDOW, Detector
from torchpass.incident.classify import classify
from torchpass.models import Category, ClassifyInput, FailureKind

K = FailureKind


class Homes:
    """Where each slot ran: 2 slots per node, `nodes` nodes."""

    def __init__(self, nodes: int) -> None:
        self.of = {s: f"node{s // 2}" for s in range(2 * nodes)}

    def home(self, slot: int) -> str | None:
        return self.of.get(slot)


@pytest.fixture
def clock() -> SimulatedClock:
    return SimulatedClock()


def _detector(nodes: int, clock: SimulatedClock) -> Detector:
    return Detector("job", Homes(nodes), timedelta(seconds=10), clock)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("nodes", "lost", "kinds"),
    [
        (4, ["node0"], [K.NODE_FAILURE]),
        (4, ["node0", "node1"], [K.NODE_FAILURE, K.FABRIC_OUTAGE]),  # half the job's nodes
        (3, ["node0", "node1"], [K.NODE_FAILURE, K.FABRIC_OUTAGE]),
        (5, ["node0", "node1"], [K.NODE_FAILURE, K.NODE_FAILURE]),  # two of five: two hosts
        (5, ["node0", "node1", "node2"], [K.NODE_FAILURE, K.NODE_FAILURE, K.FABRIC_OUTAGE]),
        (2, ["node0", "node1"], [K.NODE_FAILURE, K.FABRIC_OUTAGE]),
        (4, ["spare0"], [None]),  # a node with no rank: its spares only
    ],
)
def test_nodes_lost_together_are_a_fabric_outage(
    clock: SimulatedClock, nodes: int, lost: list[str], kinds: list[FailureKind | None]
) -> None:
    d, seen = _detector(nodes, clock), []
    for n in lost:
        clock.skip(1)
        ev = d.node_lost(n, 0.0, 2 * nodes)
        seen.append(ev.kind if ev else None)
    assert seen == kinds


def test_nodes_lost_further_apart_than_the_window_are_each_a_host_failure(
    clock: SimulatedClock,
) -> None:
    d = _detector(2, clock)
    assert d.node_lost("node0", 0.0, 4).kind is K.NODE_FAILURE  # type: ignore[union-attr]
    clock.skip(FABRIC_WINDOW.total_seconds() + 1)
    assert d.node_lost("node1", 0.0, 4).kind is K.NODE_FAILURE  # type: ignore[union-attr]


def test_an_incident_with_a_fabric_outage_in_it_is_disqualified(clock: SimulatedClock) -> None:
    d = _detector(2, clock)
    first, second = d.node_lost("node0", 0.0, 4), d.node_lost("node1", 0.0, 4)
    assert first is not None and second is not None and "2 of the job's 2 nodes" in second.detail
    inp: Any = ClassifyInput(
        evidence=(first, second), lost_slots=(0, 1, 2, 3), world_size=4, redundancy=4
    )
    c = classify(inp)
    assert (c.category, c.qualifying, c.kind) == (
        Category.SHARED_INFRASTRUCTURE,
        False,
        K.FABRIC_OUTAGE,
    )
