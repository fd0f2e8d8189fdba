"""TORCHPASS_VALIDATION_*: how the environment checks run. A section of `workers.settings`, apart
from the activities so that reading settings imports none of what the checks use."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class ValidationSettings(BaseSettings):
    """TORCHPASS_VALIDATION_* for torchpass's own knobs; the scheduler's standard variables by their
    names."""

    model_config = SettingsConfigDict(env_prefix="TORCHPASS_VALIDATION_", extra="ignore")

    allow_local: bool = Field(
        default=False,
        description="development only: waive (never pass) the scheduler check with neither "
        "Kubernetes nor Slurm; a waived check covers a job on a development contract only",
    )
    command_timeout: float = Field(
        default=10.0, gt=0, description="seconds per scontrol/sinfo call"
    )
    api_timeout: float = Field(
        default=10.0, gt=0, description="seconds per Kubernetes/Temporal call"
    )
    slurm_job_id: str | None = Field(default=None, validation_alias="SLURM_JOB_ID")
    kubernetes_service_host: str | None = Field(
        default=None, validation_alias="KUBERNETES_SERVICE_HOST"
    )
    kubeconfig: str | None = Field(default=None, validation_alias="KUBECONFIG")
