"""Environment validation for YOCO opt-in: the checks run for a job and the report the contract records.

Only a job whose latest report passed is covered by the guarantee (product brief: "Opt in to the YOCO
Guarantee and we will validate your environment"). A check passed only under a development override is
*waived*, never passed: a report with a waived check covers a job on a development contract only
(`torchpass.contract.book`, docs/contract.md).

Activities gather facts (`JobDescription` from the job's coordinator, `ControlPlaneFacts` and
`SchedulerFacts` from the control worker); the pure functions here judge them into `CheckResult`s, so that
every pass rule is unit-tested without Temporal, torch or a cluster. Nothing here imports temporalio: the
job agent builds `JobDescription` too.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from enum import StrEnum
from typing import Any, Literal

from pydantic import AwareDatetime, Field, NonNegativeInt, model_validator

from torchpass.models import Model
from torchpass.validation.versions import SUPPORTED_TORCH, version_in_range


class CheckStatus(StrEnum):
    PASSED = "passed"
    FAILED = "failed"
    WAIVED = "waived"  # passed only under a development override: never `passed`


class ReportStatus(StrEnum):
    PASSED = "passed"  # every check passed
    PASSED_WITH_WAIVERS = "passed_with_waivers"  # none failed, some waived: covers on a development contract
    FAILED = "failed"  # a check failed


class _Verdict(Model):
    @model_validator(mode="before")
    @classmethod
    def _from_passed(cls, data: Any) -> Any:
        """A payload saved before statuses existed has only `passed` (never a waiver): derive its status,
        so that old histories still decode. `passed` stays in the JSON for its readers."""
        if isinstance(data, dict) and not ("status" in data and "passed" in data):
            if "status" not in data and not isinstance(data.get("passed"), bool):
                raise ValueError("status (or, in a payload from before statuses, passed) is required")
            data = {"status": "passed" if data.get("passed") else "failed", **data}
            data.setdefault("passed", data["status"] == "passed")
        return data


class CheckResult(_Verdict):
    """One validation check: its name, its status (passed, failed or waived), and what it saw."""

    name: str = Field(min_length=1, description="e.g. 'torch_backend', 'agent_present', 'spare_pool'")
    status: CheckStatus = CheckStatus.FAILED
    passed: bool = Field(default=False, description="status is passed; a waived check is not passed")
    detail: str = Field(default="", max_length=4000)

    @model_validator(mode="after")
    def _consistent(self) -> CheckResult:
        if self.passed != (self.status is CheckStatus.PASSED):
            raise ValueError(f"check {self.name}: passed={self.passed} contradicts status {self.status}")
        return self


def report_status(checks: Sequence[CheckResult]) -> ReportStatus:
    statuses = {c.status for c in checks}
    if CheckStatus.FAILED in statuses:
        return ReportStatus.FAILED
    return ReportStatus.PASSED_WITH_WAIVERS if CheckStatus.WAIVED in statuses else ReportStatus.PASSED


class ValidationReport(_Verdict):
    """The outcome of EnvironmentValidationWorkflow for one job, recorded on its contract.

    `status`, `passed` and `waived` are the checks' verdict: a report that contradicts its checks does
    not validate, so no sender can claim a pass its checks do not show."""

    contract_id: str = Field(min_length=1, max_length=200)
    job_id: str = Field(min_length=1, max_length=200)
    status: ReportStatus = ReportStatus.FAILED
    passed: bool = Field(default=False, description="every check passed outright (none waived)")
    waived: tuple[str, ...] = Field(default=(), description="the checks passed only under an override")
    checks: tuple[CheckResult, ...] = Field(min_length=1)
    validated_at: AwareDatetime
    source: str | None = Field(
        default=None,
        max_length=1100,
        description="the EnvironmentValidationWorkflow run that made it (workflow id/run id): a contract "
        "records a report only once that run's own history shows it (torchpass.contract.verify)",
    )

    @model_validator(mode="after")
    def _consistent(self) -> ValidationReport:
        waived = tuple(c.name for c in self.checks if c.status is CheckStatus.WAIVED)
        status = report_status(self.checks)
        if (self.status, self.passed, self.waived) != (status, status is ReportStatus.PASSED, waived):
            raise ValueError(
                f"report says {self.status} (passed={self.passed}, waived={list(self.waived)}), its checks "
                f"say {status} (waived={list(waived)})"
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
    SPARES = "spare_pool"
    REDUNDANCY = "redundancy"
    RECORDED = "recorded_on_contract"


MIN_REDUNDANCY = 2
"""A shard held by a single rank cannot be rebuilt from a peer when that rank is lost."""


# --- the facts activities gather ----------------------------------------------------------------------


class ValidationTarget(Model):
    """The job a validation activity looks at."""

    job_id: str = Field(min_length=1)


class ValidateInput(Model):
    """Input of EnvironmentValidationWorkflow."""

    contract_id: str = Field(min_length=1, max_length=200)
    customer_id: str = Field(min_length=1, max_length=200)
    job_id: str = Field(min_length=1, max_length=200)
    job_task_queue: str = Field(
        default="", max_length=1000, description="empty: torchpass.ids.job_task_queue(job_id)"
    )
    job_timeout_s: float = Field(
        default=30.0, gt=0, le=600, description="how long the job's agent has to answer, retries included"
    )
    allow_local: bool = Field(
        default=False,
        description="development override: waive the scheduler check with neither Kubernetes nor Slurm "
        "(the control worker's TORCHPASS_VALIDATION_ALLOW_LOCAL does the same for every request); a waived "
        "check covers the job on a development contract only",
    )


class RecordValidationInput(Model):
    """A report to record on its contract (ContractWorkflow's `record_validation` update)."""

    customer_id: str = Field(min_length=1)
    report: ValidationReport


class RecordValidationResult(Model):
    """Whether the contract took the report; `detail` says what it answered."""

    recorded: bool
    detail: str = Field(default="", max_length=2000)


class JobDescription(Model):
    """What a job's coordinator says about itself (the `describe_job` activity)."""

    job_id: str
    agent_version: str = Field(description="torchpass.__version__ of the job's agent")
    state: str = Field(description="coordinator state: starting, training, finished, failed, ...")
    generation: int
    world_size: int = Field(ge=1)
    ranks_connected: NonNegativeInt = Field(description="live rank slots held by a connected agent")
    live_migration: bool = Field(
        default=True, description="its ranks run the agent (False: `--no-agent`, a whole-job restart)"
    )
    spares_ready: NonNegativeInt = Field(description="warm spares free to be reserved")
    spares_warming: NonNegativeInt = Field(description="spares launched but not yet warm")
    backend: Literal["gloo", "nccl"]
    backend_available: bool
    torch_version: str
    cuda_available: bool
    nccl_version: str | None = None
    parallelism: Literal["data_parallel"] = "data_parallel"
    shard_replicas: dict[str, int] = Field(description="shard -> number of ranks holding a replica of it")


class ControlPlaneFacts(Model):
    """What the control worker running the validation sees of itself and of Temporal."""

    task_queue: str
    namespace: str
    temporal_server_version: str | None = None
    temporal_error: str | None = None
    torch_version: str | None = Field(default=None, description="None: torch could not be imported")
    torch_error: str | None = None
    gloo_available: bool = False
    nccl_available: bool = False
    cuda_available: bool = False
    nccl_version: str | None = None


class SchedulerProbe(Model):
    """One scheduler looked for: found or not, and what was seen."""

    scheduler: Literal["slurm", "kubernetes"]
    found: bool
    detail: str = Field(max_length=2000)


class SchedulerFacts(Model):
    probes: tuple[SchedulerProbe, ...]
    allow_local: bool = Field(default=False, description="development override: no scheduler is waived")


def _torch_in_range(version: str) -> tuple[bool, str]:
    try:
        ok = version_in_range(version)
    except ValueError as e:
        return False, str(e)
    return ok, f"torch {version} {'is' if ok else 'is not'} in the supported range {SUPPORTED_TORCH}"


# --- the pass rules -----------------------------------------------------------------------------------


def evaluate_job(desc: JobDescription | None, unreachable: str = "") -> list[CheckResult]:
    """The job's own checks: agent present, its torch and backend, its spare pool, its redundancy.

    `desc` is None when the job did not answer `describe_job`: the agent check fails with `unreachable`
    and the checks that need the job's answer fail as not checked.
    """
    if desc is None:
        why = unreachable or "no answer"
        return [
            CheckResult(name=Check.AGENT, passed=False, detail=f"the job's agent did not answer: {why}"),
            *(
                CheckResult(name=n, passed=False, detail="not checked: the job's agent did not answer")
                for n in (Check.TORCH, Check.BACKEND, Check.SPARES, Check.REDUNDANCY)
            ),
        ]
    return [_agent(desc), _job_torch(desc), _backend(desc), _spares(desc), _redundancy(desc)]


def _agent(d: JobDescription) -> CheckResult:
    seen = (
        f"coordinator of {d.job_id} (torchpass {d.agent_version}, state {d.state}, generation "
        f"{d.generation}): {d.ranks_connected} of {d.world_size} rank slots held by a connected agent"
    )
    ok = d.ranks_connected == d.world_size and d.state == "training"
    if not ok:
        seen += "; every rank must run under the agent and the job must be training"
    if not d.live_migration:
        ok = False
        seen += (
            "; it runs without the agent (--no-agent): a failure restarts the whole job from the script's"
            " checkpoint and is never migrated live; run it under the agent (docs/adopting.md)"
        )
    return CheckResult(name=Check.AGENT, passed=ok, detail=seen)


def _job_torch(d: JobDescription) -> CheckResult:
    ok, detail = _torch_in_range(d.torch_version)
    return CheckResult(name=Check.TORCH, passed=ok, detail=f"job: {detail}")


def _backend(d: JobDescription) -> CheckResult:
    detail = f"job backend {d.backend}: {'available' if d.backend_available else 'NOT available'} in torch"
    ok = d.backend_available
    if d.backend == "nccl":
        if d.nccl_version is None:
            ok, detail = False, detail + "; NCCL version unknown"
        else:
            detail += f", NCCL {d.nccl_version}"
    elif d.cuda_available:
        ok, detail = False, detail + "; CUDA is available, so the ranks must use nccl"
    return CheckResult(name=Check.BACKEND, passed=ok, detail=detail)


def _spares(d: JobDescription) -> CheckResult:
    detail = f"{d.spares_ready} warm spare(s) ready, {d.spares_warming} warming"
    ok = d.spares_ready >= 1
    if not ok:
        detail += (
            "; an empty pool means no migration is possible (a disqualifying event), validate again once a "
            "spare is warm"
            if d.spares_warming
            else "; an empty pool means no migration is possible (a disqualifying event): run with --spares"
        )
    return CheckResult(name=Check.SPARES, passed=ok, detail=detail)


def _redundancy(d: JobDescription) -> CheckResult:
    if not d.shard_replicas:
        return CheckResult(name=Check.REDUNDANCY, passed=False, detail="the job reported no shards")
    low = {s: n for s, n in sorted(d.shard_replicas.items()) if n < MIN_REDUNDANCY}
    layout = ", ".join(f"{s}: {n}" for s, n in sorted(d.shard_replicas.items()))
    detail = f"{d.parallelism}, replicas per shard {{{layout}}}"
    if low:
        detail += (
            f"; shard(s) {', '.join(low)} below {MIN_REDUNDANCY} replicas: a lost rank could not be "
            "rebuilt from a peer (failures exceeding parallelism redundancy are not covered)"
        )
    return CheckResult(name=Check.REDUNDANCY, passed=not low, detail=detail[:4000])


def evaluate_control_plane(f: ControlPlaneFacts) -> list[CheckResult]:
    """Temporal reachable from the worker running the validation, and its torch and backends."""
    if f.temporal_error is None:
        server = f.temporal_server_version or "version not reported"
        temporal = CheckResult(
            name=Check.TEMPORAL,
            passed=True,
            detail=f"worker on task queue {f.task_queue} in namespace {f.namespace} ran the check; "
            f"server {server}",
        )
    else:
        temporal = CheckResult(
            name=Check.TEMPORAL, passed=False, detail=f"Temporal server did not answer: {f.temporal_error}"
        )
    if f.torch_version is None:
        torch = CheckResult(
            name=Check.CONTROL_TORCH, passed=False, detail=f"torch is not importable: {f.torch_error}"
        )
    else:
        ok, detail = _torch_in_range(f.torch_version)
        backends = [b for b, on in (("gloo", f.gloo_available), ("nccl", f.nccl_available)) if on]
        detail += f"; backends: {', '.join(backends) or 'none'}"
        if f.cuda_available:
            detail += f"; CUDA available, NCCL {f.nccl_version or 'unknown'}"
        ok = ok and bool(backends) and (not f.cuda_available or f.nccl_available)
        torch = CheckResult(name=Check.CONTROL_TORCH, passed=ok, detail=f"control plane: {detail}")
    return [temporal, torch]


def evaluate_scheduler(f: SchedulerFacts) -> CheckResult:
    """Kubernetes or Slurm must be found; a local run is only waived (never passed) by the dev override."""
    found = [p for p in f.probes if p.found]
    seen = "; ".join(f"{p.scheduler}: {p.detail}" for p in f.probes) or "nothing probed"
    if found:
        names = " and ".join(p.scheduler for p in found)
        return CheckResult(name=Check.SCHEDULER, passed=True, detail=f"{names} detected ({seen})"[:4000])
    if f.allow_local:
        return CheckResult(
            name=Check.SCHEDULER,
            status=CheckStatus.WAIVED,
            detail=(
                f"no Kubernetes or Slurm found ({seen}); WAIVED under the local-development override "
                "(allow_local, TORCHPASS_VALIDATION_ALLOW_LOCAL): a local run is not a TorchPass-supported "
                "environment, and a customer contract does not accept a waived check"
            )[:4000],
        )
    detail = f"neither Kubernetes nor Slurm found ({seen}); TorchPass supports jobs under one of them"
    return CheckResult(name=Check.SCHEDULER, passed=False, detail=detail[:4000])


def build_report(
    contract_id: str,
    job_id: str,
    checks: Sequence[CheckResult],
    at: datetime,
    source: str | None = None,
) -> ValidationReport:
    """The report: passed only when every check passed, passed with waivers when none failed."""
    status = report_status(checks)
    return ValidationReport(
        contract_id=contract_id,
        job_id=job_id,
        status=status,
        passed=status is ReportStatus.PASSED,
        waived=tuple(c.name for c in checks if c.status is CheckStatus.WAIVED),
        checks=tuple(checks),
        validated_at=at,
        source=source,
    )


def with_check(report: ValidationReport, check: CheckResult) -> ValidationReport:
    """The report with one more check (its verdict recomputed)."""
    return build_report(
        report.contract_id, report.job_id, (*report.checks, check), report.validated_at, report.source
    )
