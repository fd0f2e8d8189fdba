"""The validation report a contract records: each check's verdict (passed, failed or waived), the
report's status, and the inputs that ask for one and record it.

A check passed only under a development override is *waived*, never passed: a report with a waived
check covers a job on a development contract only (`torchpass.contract.coverage`,
docs/contract.md)."""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import Any

from pydantic import AwareDatetime, Field, model_validator

from torchpass.models import Model


class CheckStatus(StrEnum):
    PASSED = "passed"
    FAILED = "failed"
    WAIVED = "waived"  # passed only under a development override: never `passed`


class ReportStatus(StrEnum):
    PASSED = "passed"  # every check passed
    # none failed, some waived: covers on a development contract
    PASSED_WITH_WAIVERS = "passed_with_waivers"
    FAILED = "failed"  # a check failed


class _Verdict(Model):
    @model_validator(mode="before")
    @classmethod
    def _from_passed(cls, data: Any) -> Any:
        """A payload saved before statuses existed has only `passed` (never a waiver): derive its
        status, so that old histories still decode. `passed` stays in the JSON for its readers."""
        if isinstance(data, dict) and not ("status" in data and "passed" in data):
            if "status" not in data and not isinstance(data.get("passed"), bool):
                raise ValueError(
                    "status (or, in a payload from before statuses, passed) is required"
                )
            data = {"status": "passed" if data.get("passed") else "failed", **data}
            data.setdefault("passed", data["status"] == "passed")
        return data


class CheckResult(_Verdict):
    """One validation check: its name, its status (passed, failed or waived), and what it saw."""

    name: str = Field(
        min_length=1, description="e.g. 'torch_backend', 'agent_present', 'spare_pool'"
    )
    status: CheckStatus = CheckStatus.FAILED
    passed: bool = Field(
        default=False, description="status is passed; a waived check is not passed"
    )
    detail: str = Field(default="", max_length=4000)

    @model_validator(mode="after")
    def _consistent(self) -> CheckResult:
        if self.passed != (self.status is CheckStatus.PASSED):
            raise ValueError(
                f"check {self.name}: passed={self.passed} contradicts status {self.status}"
            )
        return self


def report_status(checks: Sequence[CheckResult]) -> ReportStatus:
    statuses = {c.status for c in checks}
    if CheckStatus.FAILED in statuses:
        return ReportStatus.FAILED
    return (
        ReportStatus.PASSED_WITH_WAIVERS if CheckStatus.WAIVED in statuses else ReportStatus.PASSED
    )


class ValidationReport(_Verdict):
    """The outcome of EnvironmentValidationWorkflow for one job, recorded on its contract.

    `status`, `passed` and `waived` are the checks' verdict: a report that contradicts its checks
    does not validate, so no sender can claim a pass its checks do not show."""

    contract_id: str = Field(min_length=1, max_length=200)
    job_id: str = Field(min_length=1, max_length=200)
    status: ReportStatus = ReportStatus.FAILED
    passed: bool = Field(default=False, description="every check passed outright (none waived)")
    waived: tuple[str, ...] = Field(
        default=(), description="the checks passed only under an override"
    )
    checks: tuple[CheckResult, ...] = Field(min_length=1)
    validated_at: AwareDatetime
    source: str | None = Field(
        default=None,
        max_length=1100,
        description="the EnvironmentValidationWorkflow run that made it (workflow id/run id): a "
        "contract records a report only once that run's own history shows it "
        "(torchpass.contract.verify)",
    )
    job_key: str | None = Field(
        default=None,
        max_length=64,
        description="the job's public key, which the contract registers: it counts an outcome of "
        "the job only with that key's signature (torchpass.incident.attestation)",
    )
    job_proof: str | None = Field(
        default=None,
        max_length=128,
        description="the job's signature with that key over its id and `source`: it holds the key",
    )
    job_endorsement: str | None = Field(
        default=None,
        max_length=128,
        description="the cluster's enrolment key's signature over the job's id and key",
    )

    @model_validator(mode="after")
    def _consistent(self) -> ValidationReport:
        waived = tuple(c.name for c in self.checks if c.status is CheckStatus.WAIVED)
        status = report_status(self.checks)
        if (self.status, self.passed, self.waived) != (
            status,
            status is ReportStatus.PASSED,
            waived,
        ):
            raise ValueError(
                f"report says {self.status} (passed={self.passed}, waived={list(self.waived)}), "
                f"its checks say {status} (waived={list(waived)})"
            )
        return self


class Check:
    """Names of the checks, in the order a report lists them."""

    TEMPORAL = "temporal_reachable"
    CONTROL_TORCH = "control_plane_torch"
    SCHEDULER = "scheduler"
    AGENT = "agent_present"
    TORCH = "torch_version"
    BACKEND = "comm_backend"
    SAME_STACK = "same_stack_on_every_node"
    SPARES = "spare_pool"
    REDUNDANCY = "redundancy"
    RECORDED = "recorded_on_contract"


class ValidateInput(Model):
    """Input of EnvironmentValidationWorkflow."""

    contract_id: str = Field(min_length=1, max_length=200)
    customer_id: str = Field(min_length=1, max_length=200)
    job_id: str = Field(min_length=1, max_length=200)
    job_task_queue: str = Field(
        default="", max_length=1000, description="empty: torchpass.ids.job_task_queue(job_id)"
    )
    job_timeout_s: float = Field(
        default=30.0,
        gt=0,
        le=600,
        description="how long the job's agent has to answer, retries included",
    )
    allow_local: bool = Field(
        default=False,
        description="development override: waive the scheduler check with neither Kubernetes nor "
        "Slurm (the control worker's TORCHPASS_VALIDATION_ALLOW_LOCAL does the same for every "
        "request); a waived check covers the job on a development contract only",
    )


class RecordValidationInput(Model):
    """A report to record on its contract (ContractWorkflow's `record_validation` update)."""

    customer_id: str = Field(min_length=1)
    report: ValidationReport


class RecordValidationResult(Model):
    """Whether the contract took the report; `detail` says what it answered."""

    recorded: bool
    detail: str = Field(default="", max_length=2000)
