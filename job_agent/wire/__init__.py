"""The job agent's wire: every frame of the control channel and the state stream, one pydantic
discriminated union (`Frame`), and the codec nothing else bypasses.

A frame is a JSON object whose `t` names its kind. `decode` turns bytes into the one model of that
kind or raises `BadFrame`, whose `error()` is the typed `Error` frame to answer with: nothing
outside this package reads a frame as a dict, and a malformed or unknown frame never reaches a
handler. Who sends what, and where each is defined:

- rank or spare <-> coordinator (`rank.py`): Hello, Heartbeat, Step, Collective, Busy, Carries,
  Redone, Ready, Frozen, Joined, Done, CheckpointSaved, UserError, DeviceError, Serving,
  TransferProgress, Served, Received, TransferFailed; Welcome, Reject, Regroup, Freeze, Assign,
  Serve, Receive, Stop, Exit
- node agent (`torchpass node`) <-> coordinator (`node.py`): NodeHello, Heartbeat, Exited,
  GpuReport, HostReport; Welcome, Reject, Spawn, Signal, Exit
- operator (`torchpass inject|drain|status`) or cluster detector -> coordinator (`operator.py`):
  Inject, Drain, NodeEvent, StatusRequest; answered with Ok, Status or Error
- donor <-> receiver (state transfer, `stream.py`): StateHeader, StateWant, StateEnd, StateAck

The authenticated transport is `protocol.py`; the rendezvous store's requests and answers,
`store.py`. Every frame class is importable from here (`wire.Hello`), where the union names them
all.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, TypeAdapter, ValidationError

from job_agent.wire.base import ID, NAME, TEXT, FrameModel
from job_agent.wire.node import (
    HOST_KINDS,
    Exited,
    GpuReport,
    HostReport,
    NodeHello,
    NodeProcess,
    Signal,
    SignalAction,
    Spawn,
)
from job_agent.wire.operator import (
    CLUSTER_FAILURES,
    CLUSTER_PLANNED,
    Drain,
    Error,
    Inject,
    InjectAction,
    InjectTarget,
    MemberState,
    NodeEvent,
    Ok,
    RankStatus,
    Status,
    StatusRequest,
)
from job_agent.wire.rank import (
    Assign,
    Busy,
    Carries,
    CheckpointSaved,
    Collective,
    DeviceError,
    Done,
    Environment,
    Exit,
    Freeze,
    Frozen,
    Heartbeat,
    Hello,
    Joined,
    Ready,
    Receive,
    Received,
    Redone,
    Regroup,
    Reject,
    Role,
    Serve,
    Served,
    Serving,
    ShardLayout,
    Step,
    Stop,
    TransferFailed,
    TransferProgress,
    UserError,
    Welcome,
)
from job_agent.wire.stream import (
    MAX_SOURCES,
    Source,
    StateAck,
    StateEnd,
    StateHeader,
    StateWant,
    TensorEntry,
)
from torchpass.errors import ErrorType

__all__ = [
    "CLUSTER_FAILURES",
    "CLUSTER_PLANNED",
    "HOST_KINDS",
    "ID",
    "MAX_SOURCES",
    "NAME",
    "TEXT",
    "Assign",
    "BadFrame",
    "Busy",
    "Carries",
    "CheckpointSaved",
    "Collective",
    "DeviceError",
    "Done",
    "Drain",
    "Environment",
    "Error",
    "Exit",
    "Exited",
    "Frame",
    "FrameModel",
    "Freeze",
    "Frozen",
    "GpuReport",
    "Heartbeat",
    "Hello",
    "HostReport",
    "Inject",
    "InjectAction",
    "InjectTarget",
    "Joined",
    "MemberState",
    "NodeEvent",
    "NodeHello",
    "NodeProcess",
    "Ok",
    "RankStatus",
    "Ready",
    "Receive",
    "Received",
    "Redone",
    "Regroup",
    "Reject",
    "Role",
    "Serve",
    "Served",
    "Serving",
    "ShardLayout",
    "Signal",
    "SignalAction",
    "Source",
    "Spawn",
    "StateAck",
    "StateEnd",
    "StateHeader",
    "StateWant",
    "Status",
    "StatusRequest",
    "Step",
    "Stop",
    "TensorEntry",
    "TransferFailed",
    "TransferProgress",
    "UserError",
    "Welcome",
    "decode",
    "encode",
]

Frame = Annotated[
    Hello
    | Heartbeat
    | Step
    | Collective
    | Busy
    | Carries
    | Redone
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
    | Stop
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
        return Error(code=self.code, reason=str(self)[:TEXT])


def encode(frame: FrameModel) -> bytes:
    return frame.model_dump_json().encode()


def decode(body: bytes) -> Frame:
    """The frame `body` holds, or BadFrame naming what is wrong (its field, or its unknown kind)."""
    try:
        return _ADAPTER.validate_json(body)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        if first["type"] == "union_tag_invalid":
            kind = str(first["ctx"].get("tag", "?"))[:ID]
            raise BadFrame(ErrorType.UNKNOWN_FRAME, f"unknown frame kind {kind!r}", kind) from None
        where = ".".join(str(p) for p in first["loc"]) or "frame"
        raise BadFrame(ErrorType.BAD_FRAME, f"bad frame: {where}: {first['msg']}"[:TEXT]) from None
