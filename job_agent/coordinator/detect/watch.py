"""The coordinator's watch, ten times a second: processes that never joined, silent nodes, hung and
silent ranks, and a world that stalled with nobody lost."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Protocol

from job_agent.coordinator.clock import Clock
from job_agent.coordinator.detect.detection import Detector
from job_agent.coordinator.incident.lifecycle import Incident
from job_agent.coordinator.incident.tracker import IncidentTracker
from job_agent.coordinator.members import Roster
from job_agent.coordinator.node_admission import cut_silent
from job_agent.coordinator.node_launcher import NodeLauncher
from job_agent.coordinator.spares import SparePool
from job_agent.launch.launcher import Launcher, signal_name
from job_agent.wire.rank import Role
from torchpass.job import JobSpec, JobState
from torchpass.models import Evidence

WATCH_EVERY = timedelta(seconds=0.1)


class Watched(Protocol):
    """What the watch reads and does (the job's coordinator)."""

    spec: JobSpec
    clock: Clock
    state: JobState
    world_size: int
    roster: Roster
    launcher: Launcher
    nodes: NodeLauncher | None
    spares: SparePool
    incidents: IncidentTracker
    detector: Detector

    def fail(self, error: str | None, state: JobState = ...) -> None: ...

    def add_evidence(self, ev: Evidence) -> None: ...


async def watch(c: Watched) -> None:
    """Until cancelled (the job's shutdown)."""
    while True:
        await c.clock.sleep(WATCH_EVERY.total_seconds())
        reap_pending(c.roster, c.launcher, c.spares, c.fail)
        if c.nodes is not None:
            cut_silent(c.nodes, c.roster, timedelta(seconds=c.spec.node_timeout))
        inc = c.incidents.current
        if c.state is JobState.TRAINING and inc is not None and inc.recovering:
            _silent_in_recovery(c, inc)
        if c.state is not JobState.TRAINING or inc is not None:
            continue
        if c.nodes is not None and c.nodes.gpu_reports:
            _gpu_reports(c, c.nodes)
        now = c.clock.monotonic()
        for ev in c.detector.hung(now):
            m = c.roster.at(ev.slots[0])
            if m is not None:
                m.fenced = True  # never report the same rank twice; confirm kills it
                c.add_evidence(ev)
        stall = c.detector.stalled(now, c.world_size) if c.incidents.current is None else None
        if stall is not None:
            c.add_evidence(stall)


def _silent_in_recovery(c: Watched, inc: Incident) -> None:
    """A process stopped while a recovery runs (a donor, a leaving rank, a receiving spare, a
    survivor) would hold it up until a timeout: it is one more loss of the recovery, killed now, so
    the plan is re-made."""
    members = [*c.roster.ranks(), *c.roster.departing(), *c.spares.held(inc.workflow_id)]
    for m, ev in c.detector.silent(c.clock.monotonic(), members):
        if ev is not None:
            m.fenced = True  # its loss is this evidence, not a second one when its socket closes
            c.add_evidence(ev)
        c.launcher.kill(m.agent_id)


def _gpu_reports(c: Watched, nodes: NodeLauncher) -> None:
    """What the nodes' GPUs said (each report may start an incident). A GPU that failed takes its
    ranks with it: they are killed now (fenced), their loss being this evidence."""
    reports, nodes.gpu_reports = nodes.gpu_reports, []
    for node, report in reports:
        ev, ranks = c.detector.gpu(node, report)
        if ev is None:
            continue
        if not report.planned:
            for m in ranks:
                m.fenced = True
                c.launcher.kill(m.agent_id)
        c.add_evidence(ev)


def reap_pending(
    roster: Roster, launcher: Launcher, spares: SparePool, fail: Callable[[str], None]
) -> None:
    """A rank that died before it ever connected (import error, bad arguments) fails the job; a
    spare that did is replaced."""
    for agent_id in list(roster.pending):
        code = launcher.poll(agent_id)
        if code is None:
            continue
        launched = roster.pending.pop(agent_id)
        if launched.role is Role.SPARE:  # a spare is replaceable: never fatal to the job
            spares.failed_start(agent_id, code)
            continue
        fail(
            f"{agent_id} exited ({signal_name(code)}) before joining the job; see its output above"
        )
