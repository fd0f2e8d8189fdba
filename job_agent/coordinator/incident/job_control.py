"""What the incident steps may see and do of a job: the coordinator implements it, the steps and the
transfer planner act through it."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Protocol

from job_agent.coordinator.incident.tracker import IncidentTracker
from job_agent.coordinator.incident.transport import StateTransport
from job_agent.coordinator.members import Member, Roster
from job_agent.coordinator.progress import StepTracker
from job_agent.coordinator.spares import SparePool
from job_agent.coordinator.waiting import Changes
from job_agent.launch.launcher import Launcher
from torchpass.incident.outcome import MigrationOutcome
from torchpass.job import JobSpec, JobState
from torchpass.models import Evidence

Tick = Callable[[int], None]


def work_seconds(t0: float) -> float:
    """A step's `work_seconds`: the time since `t0` (`time.perf_counter`) it spent on the job."""
    return time.perf_counter() - t0


class JobControl(Protocol):
    """What the incident steps may see and do of a job (the coordinator implements it)."""

    job_id: str
    spec: JobSpec
    world_size: int
    restarts: int
    covered: bool
    startup_timeout: timedelta
    hang_timeout: timedelta
    stripe_donors: int
    roster: Roster
    launcher: Launcher
    spares: SparePool
    transport: StateTransport
    progress: StepTracker
    incidents: IncidentTracker
    changes: Changes

    @property
    def generation(self) -> int: ...
    def fence(self, m: Member) -> None: ...
    def regroup(self) -> int: ...
    def abandon(self, generation: int) -> None: ...
    def restart_ranks(self, restore: str | None) -> None: ...
    def latest_checkpoint(self) -> tuple[int, str | None]: ...
    def end_incident(self, outcome: MigrationOutcome, refuted: bool = False) -> None: ...
    def add_evidence(self, ev: Evidence) -> None: ...
    def on_transfer(self, donor: Member, receivers: list[Member]) -> None: ...
    def signed(self, ev: Evidence) -> bool: ...
    def fail(self, error: str | None, state: JobState = JobState.FAILED) -> None: ...
