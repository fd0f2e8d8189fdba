"""The frames operators and cluster detectors send a job's coordinator, and its answers: failure
injection and planned moves (`torchpass inject|drain`), a cluster detector's word on a node, the
job's status (`torchpass status`)."""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal

from pydantic import (
    AwareDatetime,
    Field,
    NonNegativeInt,
    field_validator,
    model_validator,
)

from job_agent.wire.base import ID, NAME, TEXT, FrameModel
from torchpass.errors import ErrorType
from torchpass.job import JobState
from torchpass.models import FailureKind

CLUSTER_PLANNED = frozenset({FailureKind.NODE_CORDON, FailureKind.NODE_DRAIN})
CLUSTER_FAILURES = frozenset(
    {
        FailureKind.NODE_NOT_READY,
        FailureKind.NODE_FAILURE,
        FailureKind.NODE_POWER_LOSS,
        FailureKind.POD_DELETED,
    }
)


class NodeEvent(FrameModel):
    """What a cluster detector (`workers.detectors.kube`, `workers.detectors.slurm`) saw of a node:
    cordoned or drained (a planned move), or failed (NotReady, DOWN, the job's pod there deleted). A
    claim of the cluster's: the coordinator acts only on its own ranks on that node, and takes a
    failure for one only once its own view agrees (`job_agent.coordinator.detect.cluster`). `key`
    names the observation: heard twice (a restarted detector re-reading the same state), it starts
    nothing new."""

    t: Literal["node_event"] = "node_event"
    node: str = Field(pattern=NAME)
    kind: FailureKind
    source: Literal["kubernetes", "slurm"]
    reason: str = Field(default="", max_length=TEXT)
    key: str = Field(min_length=1, max_length=ID)
    observed_at: AwareDatetime

    @field_validator("kind")
    @classmethod
    def _a_nodes_kind(cls, kind: FailureKind) -> FailureKind:
        if kind not in CLUSTER_PLANNED | CLUSTER_FAILURES:
            allowed = sorted(k.value for k in CLUSTER_PLANNED | CLUSTER_FAILURES)
            raise ValueError(f"a node event is one of {allowed}, not {kind.value}")
        return kind


class StatusRequest(FrameModel):
    t: Literal["status"] = "status"


class MemberState(StrEnum):
    """A rank's or spare's state as its coordinator sees it (and `torchpass status` shows it)."""

    CONNECTED = "connected"  # said hello, still building its model
    READY = "ready"  # model built: a rank waits for its world, a spare for a slot
    JOINING = "joining"  # told to form the next generation of the world
    JOINED = "joined"  # in the new world, not yet stepping
    TRAINING = "training"
    FROZEN = "frozen"  # left a failed collective (or was asked to stop) at a step boundary
    DONE = "done"  # finished every step
    LOST = "lost"  # its connection closed: dead, fenced or gone


class RankStatus(FrameModel):
    slot: int
    agent: str
    state: MemberState
    step: int
    node: str = Field(default="", max_length=ID, description="where it runs (its failure domain)")
    pid: int = Field(default=-1, description="its process id on its node, as it said in its hello")
    device: int = Field(
        default=-1, description="its GPU index on its node (LOCAL_RANK), as it said"
    )


class Status(FrameModel):
    t: Literal["job_status"] = "job_status"
    job_id: str
    state: JobState
    generation: int
    world_size: int
    ranks: tuple[RankStatus, ...]
    spares: NonNegativeInt
    incident: str | None = None
    incidents: NonNegativeInt = Field(default=0, description="incidents recorded so far")
    nodes: tuple[str, ...] = Field(
        default=(), max_length=1024, description="node agents joined (multi-node)"
    )
    idle_nodes: tuple[str, ...] = Field(
        default=(),
        max_length=1024,
        description="joined nodes with no rank that may take some: spare nodes",
    )


class InjectAction(StrEnum):
    KILL = "kill"
    HANG = "hang"
    PAUSE = "pause"


class InjectTarget(StrEnum):
    RANK = "rank"  # the rank at `slot`
    DONOR = "donor"  # with `during="transfer"`: the replica chosen to serve the state
    RECEIVER = "receiver"  # with `during="transfer"`: the first process chosen to receive it
    # at once: a spare still starting if there is one, else a warm one (`slot` unused)
    SPARE = "spare"


class Inject(FrameModel):
    """A failure to inject: when the rank at `slot` reaches `after_step` (`during="step"`), when the
    next state transfer starts (`during="transfer"`: a second failure in the middle of a recovery),
    to `target`, or as the next recovery's group begins to form (`during="regroup"`)."""

    t: Literal["inject"] = "inject"
    action: InjectAction
    slot: NonNegativeInt
    after_step: NonNegativeInt | None = None
    seconds: float = Field(default=5.0, gt=0, le=3600, description="how long a pause lasts")
    during: Literal["step", "transfer", "regroup"] = "step"
    target: InjectTarget = InjectTarget.RANK

    @model_validator(mode="after")
    def _target_needs_a_transfer(self) -> Inject:
        if self.target is InjectTarget.SPARE:
            if self.during != "step" or self.after_step is not None:
                raise ValueError("a spare is hit at once: no after_step, not during a transfer")
        elif self.target is not InjectTarget.RANK and self.during != "transfer":
            raise ValueError(f"target {self.target.value!r} exists only during a transfer")
        return self


class Drain(FrameModel):
    t: Literal["drain"] = "drain"
    slot: NonNegativeInt
    reason: str = Field(default="operator request", max_length=500)
    kind: Literal["drain", "cordon"] = "drain"


class Ok(FrameModel):
    t: Literal["ok"] = "ok"
    detail: dict[str, Any] = Field(default_factory=dict)


class Error(FrameModel):
    t: Literal["error"] = "error"
    code: ErrorType
    reason: str = Field(max_length=TEXT)
