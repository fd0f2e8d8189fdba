"""Which failures a node's host conditions explain (`job_agent.coordinator.detect.conditions`), on
the real incident tracker with a reporter that signals nothing (what reaches Temporal is the
integration tests' business)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from job_agent import wire
from job_agent.coordinator.detect import conditions
from job_agent.coordinator.detect.conditions import HostConditions
from job_agent.coordinator.incident.lifecycle import IncidentState
from job_agent.coordinator.incident.tracker import IncidentTracker
from job_agent.coordinator.members import Member, Roster
from torchpass.models import EventSource, Evidence, FailureKind

K = FailureKind


def tracked() -> tuple[HostConditions, IncidentTracker]:
    async def reporter(workflow_id: str, report: object) -> None:
        return None

    roster = Roster()
    for slot, node in ((0, "n0"), (1, "n0"), (2, "n1")):
        m = Member(f"r-{slot}", wire.Role.RANK, slot, 100 + slot, node)
        roster.members[m.agent_id] = m
    incidents = IncidentTracker("job", lambda: 1, reporter, None)
    return HostConditions("job", roster, incidents, None), incidents


def failure(kind: FailureKind, node: str, slot: int) -> Evidence:
    return Evidence(
        kind=kind,
        source=EventSource.COORDINATOR,
        job_id="job",
        failure_domain=node,
        slots=(slot,),
        observed_at=datetime.now(UTC),
    )


def full(active: bool = True) -> wire.HostReport:
    return wire.HostReport(
        kind=K.FILESYSTEM_FULL, active=active, detail="/ckpt: 0 bytes free", path="/ckpt"
    )


def add(c: HostConditions, incidents: IncidentTracker, ev: Evidence) -> list[FailureKind]:
    incidents.add(ev)
    for cause in c.explaining(ev):
        incidents.add(cause)
    assert incidents.current is not None
    return [e.kind for e in incidents.current.evidence]


async def test_a_condition_alone_starts_nothing_and_joins_a_process_exit_of_its_node_once() -> None:
    c, incidents = tracked()
    c.heard("n0", full())
    assert incidents.current is None  # a full disk is not a failure of the job
    assert add(c, incidents, failure(K.PROCESS_EXIT, "n0", 0)) == [
        K.PROCESS_EXIT,
        K.FILESYSTEM_FULL,
    ]
    assert add(c, incidents, failure(K.CONNECTION_LOST, "n0", 1)) == [
        K.PROCESS_EXIT,
        K.FILESYSTEM_FULL,
        K.CONNECTION_LOST,
    ]


async def test_it_explains_no_failure_of_another_node_nor_a_gpu_or_a_power_loss() -> None:
    c, incidents = tracked()
    c.heard("n0", full())
    assert add(c, incidents, failure(K.PROCESS_EXIT, "n1", 2)) == [K.PROCESS_EXIT]
    c2, incidents2 = tracked()
    c2.heard("n0", full())
    assert add(c2, incidents2, failure(K.GPU_FELL_OFF_BUS, "n0", 0)) == [K.GPU_FELL_OFF_BUS]
    assert add(c2, incidents2, failure(K.NODE_FAILURE, "n0", 1)) == [
        K.GPU_FELL_OFF_BUS,
        K.NODE_FAILURE,
    ]


async def test_a_report_after_the_exit_joins_the_incident_and_an_oom_kill_names_its_process() -> (
    None
):
    c, incidents = tracked()
    add(c, incidents, failure(K.PROCESS_EXIT, "n0", 0))
    kill = wire.HostReport(kind=K.OOM_KILL, detail="r-1 OOM-killed", agent_ids=("r-1",))
    c.heard("n0", kill)  # rank 1's kill explains nothing of rank 0's exit
    assert incidents.current is not None and [e.kind for e in incidents.current.evidence] == [
        K.PROCESS_EXIT
    ]
    c.heard("n0", kill.model_copy(update={"agent_ids": ("r-0",)}))
    (oom,) = incidents.current.evidence[1:]
    assert oom.kind is K.OOM_KILL and oom.slots == (0,) and oom.source is EventSource.NODE_AGENT
    c.heard("n0", kill.model_copy(update={"agent_ids": ("r-0",)}))  # said again: joined once
    assert len(incidents.current.evidence) == 2


async def test_an_ended_condition_explains_failures_for_a_window_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    c, incidents = tracked()
    c.heard("n0", full())
    c.heard("n0", full(active=False))
    assert add(c, incidents, failure(K.PROCESS_EXIT, "n0", 0)) == [
        K.PROCESS_EXIT,
        K.FILESYSTEM_FULL,
    ]
    c2, incidents2 = tracked()
    monkeypatch.setattr(conditions, "WINDOW", conditions.timedelta(0))
    c2.heard("n0", full())
    c2.heard("n0", full(active=False))
    assert add(c2, incidents2, failure(K.PROCESS_EXIT, "n0", 0)) == [K.PROCESS_EXIT]


async def test_a_frozen_incident_takes_no_more_conditions() -> None:
    c, incidents = tracked()
    add(c, incidents, failure(K.PROCESS_EXIT, "n0", 0))
    assert incidents.current is not None
    incidents.current.move(IncidentState.FREEZING)
    c.heard("n0", full())
    assert [e.kind for e in incidents.current.evidence] == [K.PROCESS_EXIT] and not incidents.queued
