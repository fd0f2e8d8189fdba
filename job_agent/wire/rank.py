"""The frames between the coordinator and the processes it runs: each rank and spare (hello,
progress, state-transfer accounts; the commands to freeze, serve, receive, regroup), and the ones a
node agent shares with them (heartbeat, welcome, reject, exit)."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import Field, NonNegativeInt

from job_agent.wire.base import ID, TEXT, FrameModel
from job_agent.wire.stream import MAX_SOURCES, Source
from torchpass.incident.steps import Stripe


class Role(StrEnum):
    RANK = "rank"
    SPARE = "spare"


class Environment(FrameModel):
    """What a rank's own torch says of its host, for the job's environment validation: the
    coordinator runs no torch, and in a multi-node job the ranks' hosts are not its own."""

    torch_version: str = Field(min_length=1, max_length=64)
    backend: Literal["gloo", "nccl"] = Field(description="the one the agent forms its groups with")
    backend_available: bool
    cuda_available: bool
    nccl_version: str | None = Field(default=None, max_length=64)
    cuda_version: str | None = Field(
        default=None, max_length=64, description="the CUDA torch was built with (None: CPU build)"
    )
    driver_version: str | None = Field(
        default=None, max_length=64, description="the GPU driver NVML reports (None: no GPU)"
    )


# --- rank or spare -> coordinator
# ---------------------------------------------------------------------


class Hello(FrameModel):
    t: Literal["hello"] = "hello"
    agent_id: str = Field(min_length=1, max_length=ID)
    role: Role
    slot: int = Field(ge=-1)
    pid: NonNegativeInt
    device: int = Field(
        default=-1, ge=-1, le=1024, description="its GPU index on its node (LOCAL_RANK)"
    )
    rejoin: bool = Field(
        default=False, description="a running process back to a restarted coordinator"
    )
    environment: Environment | None = None


class Heartbeat(FrameModel):
    t: Literal["hb"] = "hb"


class Step(FrameModel):
    """The rank enters step k (so it completed k - 1); on a check's step, with its state's
    digest."""

    t: Literal["step"] = "step"
    k: NonNegativeInt
    digest: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")


class Collective(FrameModel):
    """The rank enters the collective of step k."""

    t: Literal["coll"] = "coll"
    k: NonNegativeInt


class Busy(FrameModel):
    """The rank starts (`busy`) or ends work its peers may wait for: not a hang (`agent.busy`)."""

    t: Literal["busy"] = "busy"
    what: str = Field(max_length=200)
    busy: bool


class Carries(FrameModel):
    """The rank fed its model a tensor the model had returned in an earlier step: state carried from
    step to step that it never declared (`job_agent.rank.inputs`). Said once per process."""

    t: Literal["carries"] = "carries"
    step: NonNegativeInt
    what: str = Field(min_length=1, max_length=500)


class Redone(FrameModel):
    """The rank's verdict on a step it does again after a peer's loss, given at the redone step's
    first forward of its model (or, where none comes first, its first collective or its end): did
    the model get the inputs it got in the step's first try?"""

    t: Literal["redone"] = "redone"
    k: NonNegativeInt
    checked: bool = Field(description="False: no forward of its first try to compare with")
    differs: str | None = Field(default=None, max_length=500)


class ShardLayout(FrameModel):
    """What part of the model a rank holds: ranks with the same `shard` are replicas of each
    other."""

    shard: str = Field(min_length=1, max_length=ID, description="digest of the shard's structure")
    parallelism: str = Field(default="data_parallel", max_length=ID)
    carried: tuple[str, ...] = Field(
        default=(),
        max_length=64,
        description="the names of the state this rank carries from step to step and no replica "
        "holds (`RankAgent.carry`): a process that takes its slot starts it afresh",
    )


class Ready(FrameModel):
    t: Literal["ready"] = "ready"
    completed: int = Field(ge=-1)
    steps: NonNegativeInt
    layout: ShardLayout | None = None


class Frozen(FrameModel):
    t: Literal["frozen"] = "frozen"
    completed: int = Field(ge=-1)
    in_flight: int | None = None
    reason: str = Field(default="", max_length=TEXT)


class Joined(FrameModel):
    t: Literal["joined"] = "joined"
    generation: NonNegativeInt
    completed: int = Field(ge=-1)
    layout: ShardLayout | None = None


class Done(FrameModel):
    t: Literal["done"] = "done"
    step: int = Field(ge=-1)
    digest: str = Field(max_length=ID)


class CheckpointSaved(FrameModel):
    t: Literal["checkpoint"] = "checkpoint"
    step: NonNegativeInt
    path: str = Field(max_length=TEXT)


class UserError(FrameModel):
    t: Literal["user_error"] = "user_error"
    step: int | None = None
    traceback: str = Field(default="", max_length=TEXT)


class DeviceError(FrameModel):
    t: Literal["device_error"] = "device_error"
    detail: str = Field(default="", max_length=TEXT)


class Serving(FrameModel):
    """The donor listens for receivers at `host`:`port` and serves its state after step `step`."""

    t: Literal["serving"] = "serving"
    host: str = Field(min_length=1, max_length=ID, description="the address its node advertises")
    port: int = Field(gt=0, lt=65536)
    step: int = Field(ge=-1)
    transfer: NonNegativeInt = Field(
        default=0, description="which transfer of the incident it answers"
    )


class TransferProgress(FrameModel):
    t: Literal["progress"] = "progress"
    bytes: NonNegativeInt


class Served(FrameModel):
    t: Literal["served"] = "served"
    digest: str = Field(max_length=ID)
    step: int = Field(ge=-1, description="the completed step the served state belongs to")
    bytes: NonNegativeInt
    seconds: float = Field(ge=0)
    stream_seconds: float | None = Field(default=None, ge=0)
    transfer: NonNegativeInt = Field(
        default=0, description="which transfer of the incident it answers"
    )


class Received(FrameModel):
    """A receiver installed the donor's state; both digests and the step are its own computation."""

    t: Literal["received"] = "received"
    stream_digest: str = Field(max_length=ID, description="over the bytes as they arrived")
    installed_digest: str = Field(max_length=ID, description="over its own state once installed")
    step: int = Field(ge=-1, description="the completed step it holds once installed")
    bytes: NonNegativeInt
    seconds: float = Field(ge=0)
    transfer: NonNegativeInt = Field(
        default=0, description="which transfer of the incident it answers"
    )
    stripes: tuple[Stripe, ...] = Field(
        default=(), max_length=4 * MAX_SOURCES, description="who sent what"
    )
    dropped: tuple[NonNegativeInt, ...] = Field(
        default=(),
        max_length=MAX_SOURCES,
        description="donors it stopped taking slices from (failed)",
    )


class TransferFailed(FrameModel):
    t: Literal["transfer_failed"] = "transfer_failed"
    error: str = Field(max_length=TEXT)
    transfer: NonNegativeInt = Field(
        default=0, description="which transfer of the incident it answers"
    )


# --- coordinator -> rank or spare
# ---------------------------------------------------------------------


class Welcome(FrameModel):
    t: Literal["welcome"] = "welcome"


class Reject(FrameModel):
    t: Literal["reject"] = "reject"
    reason: str = Field(max_length=TEXT)


class Regroup(FrameModel):
    t: Literal["regroup"] = "regroup"
    generation: NonNegativeInt
    world_size: int = Field(gt=0)


class Freeze(FrameModel):
    t: Literal["freeze"] = "freeze"
    abort: bool = Field(
        default=False,
        description="a peer is lost and may never close its connections (a hung node): cut this "
        "rank's side of its group now, so that a collective blocked on that peer fails at once",
    )


class Assign(FrameModel):
    t: Literal["assign"] = "assign"
    slot: NonNegativeInt


class Serve(FrameModel):
    t: Literal["serve"] = "serve"
    receivers: int = Field(gt=0)
    timeout: float = Field(gt=0, description="seconds")
    transfer: NonNegativeInt = Field(
        default=0, description="numbers the transfer: answers carry it back"
    )


class Receive(FrameModel):
    """Take the state from `sources` (replicas at the frozen step), in disjoint slices, all at
    once."""

    t: Literal["receive"] = "receive"
    sources: tuple[Source, ...] = Field(min_length=1, max_length=MAX_SOURCES)
    timeout: float = Field(gt=0, description="seconds")
    transfer: NonNegativeInt = Field(
        default=0, description="numbers the transfer: answers carry it back"
    )


class Stop(FrameModel):
    """To a frozen rank, when the job is stopped (Ctrl-C, SIGTERM): say what it holds (`Done`: the
    step and the digest of its state), then exit without running the script's code after the
    loop."""

    t: Literal["stop"] = "stop"


class Exit(FrameModel):
    t: Literal["exit"] = "exit"
    code: int = 0
    reason: str = Field(default="", max_length=TEXT)
