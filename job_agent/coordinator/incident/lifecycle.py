"""The incident in progress as the coordinator keeps it, and its lifecycle.

An incident is in one `IncidentState` at a time and moves by `transition` alone, which refuses a
move the steps' order does not allow (a rejoin before the freeze, a step after the outcome) with a
typed `IllegalTransition`. Who carries it out is its `Driver`: its workflow, once a workflow step
reached the job, or the job itself, when none came in time. The steps' results are kept beside the
state, so that a retried step answers what it measured the first time.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TypeVar

from job_agent import wire
from torchpass.errors import ErrorType, TorchpassError
from torchpass.incident.steps import (
    FallbackResult,
    FreezeResult,
    LocalRecord,
    RejoinResult,
    TransferProof,
)
from torchpass.models import Evidence


class IncidentError(TorchpassError):
    """A step of the incident failed; its `error_type` decides whether trying again can help."""

    def __init__(self, error_type: ErrorType, message: str) -> None:
        super().__init__(message, error_type)


class IllegalTransition(IncidentError):
    """A move the incident's lifecycle does not allow: a step out of order, or after the outcome."""

    def __init__(self, what: str, current: StrEnum, to: StrEnum) -> None:
        super().__init__(
            ErrorType.OUT_OF_ORDER, f"{what}: no move from {current.value} to {to.value}"
        )


class IncidentState(StrEnum):
    OPEN = "open"  # detected: evidence still folds in, a host condition may still join it
    FREEZING = "freezing"  # freeze_ranks began: a failure now is one more loss of this recovery
    FROZEN = "frozen"  # every survivor stopped at one step boundary (`Incident.frozen`)
    MOVED = "moved"  # the state reached every receiver (`Incident.proof`); again after a later loss
    TRAINING = "training"  # the group re-formed and every rank trains again (`Incident.rejoined`)
    RESTARTING = "restarting"  # the fallback: every rank restarts from the checkpoint
    RESTARTED = "restarted"  # ... and trains again (`Incident.fallback`)
    COMPLETED = "completed"  # its outcome is recorded on the job: nothing moves it again


class Driver(StrEnum):
    WAITING = "waiting"  # no workflow step yet: the job waits `LOCAL_AFTER` for one
    WORKFLOW = "workflow"  # a workflow step reached the job: its workflow carries it out
    JOB = "job"  # none came in time (the control plane away): the job carries it out itself


S, D = IncidentState, Driver
MOVES: dict[StrEnum, frozenset[StrEnum]] = {
    # A step may be tried again (a retried activity) where it moves to its own state; any phase may
    # end in its outcome (the workflow records a failure wherever the recovery stopped).
    S.OPEN: frozenset({S.FREEZING, S.RESTARTING, S.COMPLETED}),
    S.FREEZING: frozenset({S.FREEZING, S.FROZEN, S.RESTARTING, S.COMPLETED}),
    S.FROZEN: frozenset({S.MOVED, S.RESTARTING, S.COMPLETED}),
    S.MOVED: frozenset({S.MOVED, S.TRAINING, S.RESTARTING, S.COMPLETED}),
    # a proof that fails after the rejoin falls back
    S.TRAINING: frozenset({S.RESTARTING, S.COMPLETED}),
    S.RESTARTING: frozenset({S.RESTARTING, S.RESTARTED, S.COMPLETED}),
    S.RESTARTED: frozenset({S.COMPLETED}),
    S.COMPLETED: frozenset(),
    # Who drives it: a squatter's step answered for it, and the incident moved to a fresh id, waits
    # again.
    D.WAITING: frozenset({D.WAITING, D.WORKFLOW, D.JOB}),
    D.WORKFLOW: frozenset({D.WORKFLOW, D.WAITING}),
    D.JOB: frozenset({D.JOB}),
}
RECOVERING = frozenset({S.FREEZING, S.FROZEN, S.MOVED})
T = TypeVar("T", IncidentState, Driver)


def transition(current: T, to: T, what: str = "incident") -> T:
    """`to`, when the lifecycle allows the move from `current`; else `IllegalTransition`."""
    if to not in MOVES[current]:
        raise IllegalTransition(what, current, to)
    return to


@dataclass
class Transfers:
    """The state transfers of one recovery so far (several when a donor or receiver was lost)."""

    got: dict[int, tuple[str, wire.Received, int]] = field(
        default_factory=dict
    )  # slot: agent, account, donor
    # donor slot and its account
    served: list[tuple[int, wire.Served]] = field(default_factory=list)
    moves: int = 0
    shards: set[str | None] = field(default_factory=set)  # the shards moved (one, data parallel)


@dataclass
class Incident:
    """What the coordinator remembers of the incident in progress."""

    workflow_id: str
    evidence: list[Evidence] = field(default_factory=list)
    lost: set[int] = field(default_factory=set)
    leaving: set[int] = field(default_factory=set)  # planned: healthy until frozen, then fenced
    # the slots confirm found lost; the rest were lost later
    confirmed: frozenset[int] = frozenset()
    state: IncidentState = IncidentState.OPEN
    driver: Driver = Driver.WAITING
    frozen: FreezeResult | None = None
    proof: TransferProof | None = None
    transfers: Transfers = field(default_factory=Transfers)
    rejoined: RejoinResult | None = None
    fallback: FallbackResult | None = None
    generation: int = -1  # the world generation its reports carry (the first report's)
    rekeyed: int = 0  # times it moved to a fresh id because a squatter held its own
    record: LocalRecord | None = None  # what the job did, once it is done (driven by the job only)
    recorded: asyncio.Event = field(default_factory=asyncio.Event)
    deliveries: set[asyncio.Task[None]] = field(default_factory=set)
    # The delivery of the report that names the workflow (its first evidence): the others wait for
    # it, so the workflow is started by that report and its id is the one its start input keys
    # (`torchpass.contract.verify`).
    lead: dict[str, asyncio.Task[None]] = field(default_factory=dict)

    def move(self, to: IncidentState) -> None:
        self.state = transition(self.state, to, f"incident {self.workflow_id}")

    def allows(self, to: IncidentState) -> None:
        """Refuse now, before a step does any work, a step whose end the lifecycle would not
        allow."""
        transition(self.state, to, f"incident {self.workflow_id}")

    def drive(self, by: Driver) -> None:
        self.driver = transition(self.driver, by, f"incident {self.workflow_id}'s driver")

    @property
    def past_freeze(self) -> bool:
        """Its world is decided: frozen for a recovery, restarted, or done. New evidence waits."""
        return self.state is not IncidentState.OPEN

    @property
    def recovering(self) -> bool:
        """Frozen and not yet training again: a failure now is one more loss of this recovery, whose
        plan is re-made around it, not a failure of the world the recovery is building."""
        return self.state in RECOVERING
