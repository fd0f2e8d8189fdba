"""The base of every frame of the control channel, the frames between a node agent and its job's
coordinator, and the job's status as an operator asks for it. `job_agent.wire` holds them all in one
union: nothing else decodes a frame."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import (
    Field,
    NonNegativeInt,
    field_validator,
    model_validator,
)

from job_agent.wire.base import ID, NAME, TEXT, FrameModel
from torchpass.models import FailureKind


class NodeProcess(FrameModel):
    """A process a node agent started: the slot it was started for (-1: a spare) and, once it ended,
    its exit status."""

    agent_id: str = Field(min_length=1, max_length=ID)
    slot: int = Field(ge=-1, le=1024)
    code: int | None = None


class NodeHello(FrameModel):
    """A node agent joins its job: it runs up to `slots` ranks and `spares` warm spares (no slots: a
    spare node), and its processes advertise `host` to their peers.

    `rejoin`: the node is back to a restarted coordinator, with the slots from `first_slot` on and
    every process it started (those running, and those that ended while it had no coordinator)."""

    t: Literal["node_hello"] = "node_hello"
    job_id: str = Field(pattern=NAME)
    node: str = Field(pattern=NAME)
    host: str = Field(min_length=1, max_length=ID)
    slots: int = Field(ge=0, le=1024)
    spares: int = Field(ge=0, le=64)
    pid: NonNegativeInt
    rejoin: bool = False
    first_slot: int = Field(default=-1, ge=-1, le=1024)
    processes: tuple[NodeProcess, ...] = Field(default=(), max_length=4096)


# torchrun's names for what a worker is, which a rank is given beside the agent's settings
TORCHRUN_NAMES = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "ROLE_RANK",
        "ROLE_NAME",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_MAX_RESTARTS",
        "TORCHELASTIC_USE_AGENT_STORE",
    }
)


class Spawn(FrameModel):
    """Start one rank or spare of the node's own command, with these agent settings (TORCHPASS_*)
    and torchrun's names for the worker (`TORCHRUN_NAMES`), nothing else (no LD_PRELOAD, no
    PATH)."""

    t: Literal["spawn"] = "spawn"
    agent_id: str = Field(min_length=1, max_length=ID)
    env: dict[str, str] = Field(max_length=64)

    @model_validator(mode="after")
    def _agent_settings_only(self) -> Spawn:
        for k, v in self.env.items():
            named = k.startswith("TORCHPASS_") or k in TORCHRUN_NAMES
            if not named or len(k) > ID or len(v) > TEXT:
                raise ValueError(f"not an agent setting: {k[:ID]!r}")
        return self


class SignalAction(StrEnum):
    KILL = "kill"
    STOP = "stop"
    CONT = "cont"


class Signal(FrameModel):
    t: Literal["signal"] = "signal"
    agent_id: str = Field(min_length=1, max_length=ID)
    action: SignalAction


class Exited(FrameModel):
    """A process the node started has ended with `code` (negative: the signal that ended it)."""

    t: Literal["exited"] = "exited"
    agent_id: str = Field(min_length=1, max_length=ID)
    code: int


class GpuReport(FrameModel):
    """What one of the node's GPUs says (`job_agent.node.gpu_health`), with the node's processes on
    it: a failure of the GPU, or a warning (`planned`: move them off while it works). A claim of the
    node's: the coordinator acts only on those of the processes that are its ranks on that node."""

    t: Literal["gpu_report"] = "gpu_report"
    gpu: int = Field(ge=0, le=1024)
    agent_ids: tuple[str, ...] = Field(min_length=1, max_length=64)
    kind: FailureKind
    planned: bool
    detail: str = Field(max_length=TEXT)
    xid: int | None = Field(default=None, ge=0, le=2**20)

    @field_validator("agent_ids")
    @classmethod
    def _once_each(cls, agent_ids: tuple[str, ...]) -> tuple[str, ...]:
        if any(not a or len(a) > ID for a in agent_ids):
            raise ValueError("an agent id is 1 to 200 characters")
        return tuple(dict.fromkeys(agent_ids))

    @model_validator(mode="after")
    def _a_gpus_kind(self) -> GpuReport:
        """A GPU speaks of itself: a node cannot start an incident of another kind through it."""
        kinds = _GPU_WARNINGS if self.planned else _GPU_FAILURES
        if self.kind not in kinds:
            what = "warning" if self.planned else "failure"
            raise ValueError(
                f"a GPU {what} is one of {sorted(k.value for k in kinds)}, not {self.kind.value}"
            )
        return self


class HostReport(FrameModel):
    """What the node agent sees of its own host (`job_agent.node.host_health`): a watched filesystem
    full or unmounted, the host out of memory (`active`: it began; else it ended), or one of its
    processes OOM-killed (`agent_ids`: that process). A claim of the node's: the coordinator only
    adds it to the evidence of a failure of that node's ranks
    (`job_agent.coordinator.detect.conditions`); on its own it starts nothing."""

    t: Literal["host_report"] = "host_report"
    kind: FailureKind
    active: bool = True
    detail: str = Field(max_length=TEXT)
    path: str = Field(default="", max_length=TEXT)
    agent_ids: tuple[str, ...] = Field(default=(), max_length=64)

    @field_validator("kind")
    @classmethod
    def _a_hosts_kind(cls, kind: FailureKind) -> FailureKind:
        if kind not in HOST_KINDS:
            allowed = sorted(k.value for k in HOST_KINDS)
            raise ValueError(f"a host report is one of {allowed}, not {kind.value}")
        return kind

    @field_validator("agent_ids")
    @classmethod
    def _ids(cls, agent_ids: tuple[str, ...]) -> tuple[str, ...]:
        if any(not a or len(a) > ID for a in agent_ids):
            raise ValueError("an agent id is 1 to 200 characters")
        return tuple(dict.fromkeys(agent_ids))


HOST_KINDS = frozenset(
    {
        FailureKind.FILESYSTEM_FULL,
        FailureKind.FILESYSTEM_UNMOUNTED,
        FailureKind.HOST_MEMORY_EXHAUSTED,
        FailureKind.OOM_KILL,
    }
)


_GPU_FAILURES = frozenset(
    {
        FailureKind.GPU_FELL_OFF_BUS,
        FailureKind.GPU_ECC_UNCORRECTABLE,
        FailureKind.NVLINK_ERROR,
        FailureKind.GPU_LOST,
    }
)
_GPU_WARNINGS = frozenset({FailureKind.GPU_TEMPERATURE, FailureKind.GPU_ECC_UNCORRECTABLE})


# --- operator -> coordinator, and its answer
# ----------------------------------------------------------
