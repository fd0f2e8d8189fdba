"""The node agent's settings (`torchpass node`): the job it joins, this host's address and share of
the job, and how it watches its GPUs and its host."""

from __future__ import annotations

import socket
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field


class NodeSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    job_id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    node: str = Field(
        default_factory=socket.gethostname, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
    )
    coordinator: str = Field(
        min_length=3, max_length=300, description="host:port the coordinator printed"
    )
    host: str = Field(
        min_length=1, max_length=200, description="this node's address, reachable by peers"
    )
    secret_file: Path
    slots: int = Field(
        default=0, ge=0, le=1024, description="ranks this node runs; 0: a spare node"
    )
    spares: int = Field(default=0, ge=0, le=64, description="warm spares this node keeps")
    coordinator_wait: float = Field(
        default=120.0,
        ge=0,
        le=86400,
        description="seconds its processes train on without the coordinator while it waits for it "
        "to be back (restarted); 0: they stop with it",
    )
    gpu_check_every: float = Field(
        default=1.0,
        ge=0,
        le=3600,
        description="seconds between reads of the GPUs' health (0: never)",
    )
    max_gpu_temperature: int = Field(
        default=85, ge=30, le=150, description="Celsius: move ranks off above"
    )
    watch_paths: tuple[Path, ...] = Field(
        default=(),
        max_length=16,
        description="filesystems the job writes to (checkpoints), checked for room",
    )
    min_free_disk: int = Field(
        default=64 << 20, ge=0, description="bytes under which a watched path is full"
    )
    min_free_memory: float = Field(
        default=0.02,
        ge=0,
        le=1,
        description="share of memory available under which the host is out of it",
    )
    host_check_every: float = Field(
        default=1.0,
        ge=0,
        le=3600,
        description="seconds between reads of the host's filesystems and memory",
    )
    proc: Path = Field(
        default=Path("/proc"), description="the host's /proc (in a container: where mounted)"
    )
    script: Path
    args: tuple[str, ...] = ()

    def coordinator_addr(self) -> tuple[str, int]:
        host, _, port = self.coordinator.rpartition(":")
        return host, int(port)
