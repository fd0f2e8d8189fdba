"""One settings object per torchpass process (CLI, control worker, job worker): read once, at
start-up.

Each section keeps the environment prefix it documents (deploy/README.md): TORCHPASS_STATE_DIR,
TORCHPASS_TEMPORAL_*, TORCHPASS_OTEL_*, TORCHPASS_BILLING_*, TORCHPASS_VALIDATION_*. `Settings.load`
reads all of them, applies the command line's overrides, and fails at once with a typed
`ValidationError` naming the field; nothing deeper in the process reads `os.environ`. (A rank's own
settings are `job_agent.rank.settings.AgentSettings`, set by its coordinator.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from activities.billing_settings import BillingSettings
from activities.validation_settings import ValidationSettings
from workers.telemetry import TelemetrySettings
from workers.temporal import TemporalSettings


def _default_state_dir() -> Path:
    return Path.home() / ".local" / "state" / "torchpass"


class _Paths(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TORCHPASS_", extra="ignore")

    state_dir: Path = Field(
        default_factory=_default_state_dir, description="job registry, checkpoints"
    )


class Settings(BaseModel):
    """Everything a torchpass process is configured with."""

    model_config = ConfigDict(frozen=True)

    state_dir: Path = Field(default_factory=_default_state_dir)
    temporal: TemporalSettings = Field(default_factory=TemporalSettings)
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings)
    billing: BillingSettings = Field(default_factory=BillingSettings)
    validation: ValidationSettings = Field(default_factory=ValidationSettings)

    @classmethod
    def load(cls, **sections: dict[str, Any]) -> Settings:
        """The environment, with `sections`' fields (e.g. `temporal={"address": ...}`) given
        precedence."""
        return cls(
            state_dir=sections.get("paths", {}).get("state_dir") or _Paths().state_dir,
            temporal=TemporalSettings(**sections.get("temporal", {})),
            telemetry=TelemetrySettings(**sections.get("telemetry", {})),
            billing=BillingSettings(**sections.get("billing", {})),
            validation=ValidationSettings(**sections.get("validation", {})),
        )
