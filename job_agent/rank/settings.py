"""The rank agent's settings: set by `torchpass run` in each rank's and spare's environment."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from job_agent import wire


class AgentSettings(BaseSettings):
    """Read once at start-up from TORCHPASS_* variables; nothing deeper reads os.environ."""

    model_config = SettingsConfigDict(env_prefix="TORCHPASS_", extra="ignore")

    job_id: str
    agent_id: str = Field(description="unique per process; a fenced id is never let back in")
    role: Literal["rank", "spare"]
    slot: int = Field(default=-1, description="rank slot; -1 for a spare until it is assigned one")
    world_size: int = Field(gt=0)
    coordinator: str = Field(description="host:port of the coordinator's control channel")
    store: str = Field(description="host:port of the rendezvous TCPStore hosted by the coordinator")
    secret_file: Path
    advertise_host: str = Field(
        description="the address its node advertises: its state server listens there"
    )
    restore: Path | None = Field(default=None, description="checkpoint to restart from")
    checkpoint_dir: Path | None = None
    checkpoint_every: int = Field(
        default=0, ge=0, description="steps between checkpoints; 0: never"
    )
    verify_every: int = Field(
        default=0, ge=0, description="steps between replica digest checks; 0: never"
    )
    keep_checkpoints: int = Field(default=2, ge=1, description="the latest checkpoints kept")
    seed: int = 0
    threads: int = Field(
        default=1, gt=0, description="torch.set_num_threads, the same on every rank"
    )
    heartbeat_interval: float = Field(default=0.2, gt=0)
    collective_timeout: float = Field(default=60.0, gt=0)
    recovery_timeout: float = Field(default=300.0, gt=0)
    rejoin_for: float = Field(
        default=0.0,
        ge=0,
        le=86400,
        description="seconds it goes on training without its coordinator, rejoining it (a "
        "restarted one at the same address); 0: it stops at once (its node agent sets this)",
    )
    device: str = Field(
        default="auto", description="'auto': cuda:<local rank> when a GPU is present"
    )
    local_rank: int = Field(
        default=0, ge=0, validation_alias="LOCAL_RANK", description="GPU index on the node"
    )

    @property
    def coordinator_addr(self) -> tuple[str, int]:
        return _split(self.coordinator)

    @property
    def store_addr(self) -> tuple[str, int]:
        return _split(self.store)

    def read_secret(self) -> bytes:
        return bytes.fromhex(self.secret_file.read_text().strip())

    def hello(
        self,
        role: wire.Role,
        slot: int,
        environment: wire.Environment | None = None,
        rejoin: bool = False,
    ) -> wire.Hello:
        """What this process says first to its coordinator: who and where it is, and what its torch
        offers."""
        return wire.Hello(
            agent_id=self.agent_id,
            role=role,
            slot=slot,
            pid=os.getpid(),
            device=self.local_rank,
            environment=environment,
            rejoin=rejoin,
        )


def _split(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host, int(port)
