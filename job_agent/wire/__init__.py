"""Every frame of the control channel and the state stream, as one pydantic discriminated union.

A frame is a JSON object whose `t` names its kind. `decode` turns bytes into the one model of that kind or
raises `BadFrame`, whose `error()` is the typed `Error` frame to answer with: nothing outside this module
reads a frame as a dict, and a malformed or unknown frame never reaches a handler. Who sends what:

- rank or spare -> coordinator: Hello, Heartbeat, Step, Collective, Busy, Ready, Frozen, Joined, Done,
  CheckpointSaved, UserError, DeviceError, Serving, TransferProgress, Served, Received, TransferFailed
- coordinator -> rank or spare: Welcome, Reject, Regroup, Freeze, Assign, Serve, Receive, Exit
- operator (`torchpass inject|drain|status`, a cluster detector) -> coordinator: Inject, Drain, NodeEvent,
  StatusRequest; answered with Ok, Status or Error
- node agent (`torchpass node`) -> coordinator: NodeHello, Heartbeat, Exited, GpuReport, HostReport; to
  the node: Welcome, Reject, Spawn, Signal, Exit
- donor <-> receiver (state transfer, `job_agent.wire.stream`): StateHeader, StateWant, StateEnd, StateAck

The rendezvous store's requests and answers are in `job_agent.rank.store`.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import Field, NonNegativeInt, TypeAdapter, ValidationError, model_validator

from job_agent.wire.node import ID as _ID
from job_agent.wire.node import TEXT as _TEXT
from job_agent.wire.node import (
    Exited,
    GpuReport,
    HostReport,
    NodeEvent,
    NodeHello,
    Signal,
    Spawn,
    Status,
    StatusRequest,
)
from job_agent.wire.node import FrameModel as _Frame
from job_agent.wire.stream import (
    MAX_SOURCES,
    Source,
    StateAck,
    StateEnd,
    StateHeader,
    StateWant,
)
from torchpass.errors import ErrorType
from torchpass.incident.steps import Stripe


class Role(StrEnum):
    RANK = "rank"
    SPARE = "spare"


# --- rank or spare -> coordinator ---------------------------------------------------------------------


class Environment(_Frame):
    """What a rank's own torch says of its host, for the job's environment validation: the coordinator
    runs no torch, and in a multi-node job the ranks' hosts are not its own."""

    torch_version: str = Field(min_length=1, max_length=64)
    backend: Literal["gloo", "nccl"] = Field(description="the one the agent forms its groups with")
    backend_available: bool
    cuda_available: bool
    nccl_version: str | None = Field(default=None, max_length=64)


class Hello(_Frame):
    t: Literal["hello"] = "hello"
    agent_id: str = Field(min_length=1, max_length=_ID)
    role: Role
    slot: int = Field(ge=-1)
    pid: NonNegativeInt
    device: int = Field(default=-1, ge=-1, le=1024, description="its GPU index on its node (LOCAL_RANK)")
    rejoin: bool = Field(default=False, description="a running process back to a restarted coordinator")
    environment: Environment | None = None


class Heartbeat(_Frame):
    t: Literal["hb"] = "hb"


class Step(_Frame):
    """The rank enters step k (so it completed k - 1); on a check's step, with its state's digest."""

    t: Literal["step"] = "step"
    k: NonNegativeInt
    digest: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")


class Collective(_Frame):
    """The rank enters the collective of step k."""

    t: Literal["coll"] = "coll"
    k: NonNegativeInt


class Busy(_Frame):
    """The rank starts (`busy`) or ends work its peers may wait for: not a hang (`agent.busy`)."""

    t: Literal["busy"] = "busy"
    what: str = Field(max_length=200)
    busy: bool


class ShardLayout(_Frame):
    """What part of the model a rank holds: ranks with the same `shard` are replicas of each other."""

    shard: str = Field(min_length=1, max_length=_ID, description="digest of the shard's structure")
    parallelism: str = Field(default="data_parallel", max_length=_ID)


class Ready(_Frame):
    t: Literal["ready"] = "ready"
    completed: int = Field(ge=-1)
    steps: NonNegativeInt
    layout: ShardLayout | None = None


class Frozen(_Frame):
    t: Literal["frozen"] = "frozen"
    completed: int = Field(ge=-1)
    in_flight: int | None = None
    reason: str = Field(default="", max_length=_TEXT)


class Joined(_Frame):
    t: Literal["joined"] = "joined"
    generation: NonNegativeInt
    completed: int = Field(ge=-1)
    layout: ShardLayout | None = None


class Done(_Frame):
    t: Literal["done"] = "done"
    step: int = Field(ge=-1)
    digest: str = Field(max_length=_ID)


class CheckpointSaved(_Frame):
    t: Literal["checkpoint"] = "checkpoint"
    step: NonNegativeInt
    path: str = Field(max_length=_TEXT)


class UserError(_Frame):
    t: Literal["user_error"] = "user_error"
    step: int | None = None
    traceback: str = Field(default="", max_length=_TEXT)


class DeviceError(_Frame):
    t: Literal["device_error"] = "device_error"
    detail: str = Field(default="", max_length=_TEXT)


class Serving(_Frame):
    """The donor listens for receivers at `host`:`port` and serves its state after step `step`."""

    t: Literal["serving"] = "serving"
    host: str = Field(min_length=1, max_length=_ID, description="the address its node advertises")
    port: int = Field(gt=0, lt=65536)
    step: int = Field(ge=-1)
    transfer: NonNegativeInt = Field(default=0, description="which transfer of the incident it answers")


class TransferProgress(_Frame):
    t: Literal["progress"] = "progress"
    bytes: NonNegativeInt


class Served(_Frame):
    t: Literal["served"] = "served"
    digest: str = Field(max_length=_ID)
    step: int = Field(ge=-1, description="the completed step the served state belongs to")
    bytes: NonNegativeInt
    seconds: float = Field(ge=0)
    stream_seconds: float | None = Field(default=None, ge=0)
    transfer: NonNegativeInt = Field(default=0, description="which transfer of the incident it answers")


class Received(_Frame):
    """A receiver installed the donor's state; both digests and the step are its own computation."""

    t: Literal["received"] = "received"
    stream_digest: str = Field(max_length=_ID, description="over the bytes as they arrived")
    installed_digest: str = Field(max_length=_ID, description="over its own state once installed")
    step: int = Field(ge=-1, description="the completed step it holds once installed")
    bytes: NonNegativeInt
    seconds: float = Field(ge=0)
    transfer: NonNegativeInt = Field(default=0, description="which transfer of the incident it answers")
    stripes: tuple[Stripe, ...] = Field(default=(), max_length=4 * MAX_SOURCES, description="who sent what")
    dropped: tuple[NonNegativeInt, ...] = Field(
        default=(), max_length=MAX_SOURCES, description="donors it stopped taking slices from (failed)"
    )


class TransferFailed(_Frame):
    t: Literal["transfer_failed"] = "transfer_failed"
    error: str = Field(max_length=_TEXT)
    transfer: NonNegativeInt = Field(default=0, description="which transfer of the incident it answers")


# --- coordinator -> rank or spare ---------------------------------------------------------------------


class Welcome(_Frame):
    t: Literal["welcome"] = "welcome"


class Reject(_Frame):
    t: Literal["reject"] = "reject"
    reason: str = Field(max_length=_TEXT)


class Regroup(_Frame):
    t: Literal["regroup"] = "regroup"
    generation: NonNegativeInt
    world_size: int = Field(gt=0)


class Freeze(_Frame):
    t: Literal["freeze"] = "freeze"
    abort: bool = Field(
        default=False,
        description="a peer is lost and may never close its connections (a hung node): cut this rank's "
        "side of its group now, so that a collective blocked on that peer fails at once",
    )


class Assign(_Frame):
    t: Literal["assign"] = "assign"
    slot: NonNegativeInt


class Serve(_Frame):
    t: Literal["serve"] = "serve"
    receivers: int = Field(gt=0)
    timeout: float = Field(gt=0, description="seconds")
    transfer: NonNegativeInt = Field(default=0, description="numbers the transfer: answers carry it back")


class Receive(_Frame):
    """Take the state from `sources` (replicas at the frozen step), in disjoint slices, all at once."""

    t: Literal["receive"] = "receive"
    sources: tuple[Source, ...] = Field(min_length=1, max_length=MAX_SOURCES)
    timeout: float = Field(gt=0, description="seconds")
    transfer: NonNegativeInt = Field(default=0, description="numbers the transfer: answers carry it back")


class Exit(_Frame):
    t: Literal["exit"] = "exit"
    code: int = 0
    reason: str = Field(default="", max_length=_TEXT)


# --- operator -> coordinator, and the answers -----------------------------------------------------------


class InjectAction(StrEnum):
    KILL = "kill"
    HANG = "hang"
    PAUSE = "pause"


class InjectTarget(StrEnum):
    RANK = "rank"  # the rank at `slot`
    DONOR = "donor"  # with `during="transfer"`: the replica chosen to serve the state
    RECEIVER = "receiver"  # with `during="transfer"`: the first process chosen to receive it
    SPARE = "spare"  # at once: a spare still starting if there is one, else a warm one (`slot` unused)


class Inject(_Frame):
    """A failure to inject: when the rank at `slot` reaches `after_step` (`during="step"`), when the
    next state transfer starts (`during="transfer"`: a second failure in the middle of a recovery), to
    `target`, or as the next recovery's group begins to form (`during="regroup"`)."""

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


class Drain(_Frame):
    t: Literal["drain"] = "drain"
    slot: NonNegativeInt
    reason: str = Field(default="operator request", max_length=500)
    kind: Literal["drain", "cordon"] = "drain"


class Ok(_Frame):
    t: Literal["ok"] = "ok"
    detail: dict[str, Any] = Field(default_factory=dict)


class Error(_Frame):
    t: Literal["error"] = "error"
    code: ErrorType
    reason: str = Field(max_length=_TEXT)


Frame = Annotated[
    Hello
    | Heartbeat
    | Step
    | Collective
    | Busy
    | Ready
    | Frozen
    | Joined
    | Done
    | CheckpointSaved
    | UserError
    | DeviceError
    | Serving
    | TransferProgress
    | Served
    | Received
    | TransferFailed
    | Welcome
    | Reject
    | Regroup
    | Freeze
    | Assign
    | Serve
    | Receive
    | Exit
    | NodeHello
    | Spawn
    | Signal
    | Exited
    | GpuReport
    | HostReport
    | NodeEvent
    | Inject
    | Drain
    | StatusRequest
    | Status
    | Ok
    | Error
    | StateHeader
    | StateWant
    | StateEnd
    | StateAck,
    Field(discriminator="t"),
]
_ADAPTER: TypeAdapter[Frame] = TypeAdapter(Frame)


class BadFrame(Exception):
    """A frame that is not JSON, of no known kind, or with a field missing or wrong."""

    def __init__(self, code: ErrorType, reason: str, kind: str | None = None) -> None:
        super().__init__(reason)
        self.code = code
        self.kind = kind

    def error(self) -> Error:
        return Error(code=self.code, reason=str(self)[:_TEXT])


def encode(frame: _Frame) -> bytes:
    return frame.model_dump_json().encode()


def decode(body: bytes) -> Frame:
    """The frame `body` holds, or BadFrame naming what is wrong (its field, or its unknown kind)."""
    try:
        return _ADAPTER.validate_json(body)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        if first["type"] == "union_tag_invalid":
            kind = str(first["ctx"].get("tag", "?"))[:_ID]
            raise BadFrame(ErrorType.UNKNOWN_FRAME, f"unknown frame kind {kind!r}", kind) from None
        where = ".".join(str(p) for p in first["loc"]) or "frame"
        raise BadFrame(ErrorType.BAD_FRAME, f"bad frame: {where}: {first['msg']}"[:_TEXT]) from None
