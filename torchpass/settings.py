"""Settings shared by the CLI's commands, read once from TORCHPASS_* variables."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


def _default_state_dir() -> Path:
    return Path.home() / ".local" / "state" / "torchpass"


class CliSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TORCHPASS_", extra="ignore")

    state_dir: Path = Field(default_factory=_default_state_dir, description="job registry, checkpoints")
