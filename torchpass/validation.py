"""Environment validation for YOCO opt-in: the checks run for a job and the report the contract records.

Only a job whose latest report passed is covered by the guarantee (product brief: "Opt in to the YOCO
Guarantee and we will validate your environment").
"""

from __future__ import annotations

from pydantic import AwareDatetime, Field

from torchpass.models import Model


class CheckResult(Model):
    """One validation check: its name, whether it passed, and what it saw."""

    name: str = Field(min_length=1, description="e.g. 'torch_backend', 'agent_present', 'spare_pool'")
    passed: bool
    detail: str = Field(default="", max_length=4000)


class ValidationReport(Model):
    """The outcome of EnvironmentValidationWorkflow for one job, recorded on its contract."""

    contract_id: str = Field(min_length=1)
    job_id: str = Field(min_length=1)
    passed: bool = Field(description="every check passed")
    checks: tuple[CheckResult, ...] = Field(min_length=1)
    validated_at: AwareDatetime
