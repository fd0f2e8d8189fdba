"""Environment validation for YOCO opt-in: the pass rules of each check, and the report they make.

Only a job whose latest report passed is covered by the guarantee (product brief: "Opt in to the
YOCO Guarantee and we will validate your environment"). Activities gather the facts (`facts.py`);
the pure functions here judge them into `CheckResult`s (`report.py`), so that every pass rule is
unit-tested without Temporal, torch or a cluster.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from torchpass.validation.facts import (
    ControlPlaneFacts,
    JobDescription,
    RankEnvironment,
    SchedulerFacts,
)
from torchpass.validation.report import (
    Check,
    CheckResult,
    CheckStatus,
    ReportStatus,
    ValidationReport,
    report_status,
)
from torchpass.validation.versions import SUPPORTED_TORCH, version_in_range

MIN_REDUNDANCY = 2
"""A shard held by a single rank cannot be rebuilt from a peer when that rank is lost."""


def _torch_in_range(version: str) -> tuple[bool, str]:
    try:
        ok = version_in_range(version)
    except ValueError as e:
        return False, str(e)
    return (
        ok,
        f"torch {version} {'is' if ok else 'is not'} in the supported range {SUPPORTED_TORCH}",
    )


# --- the pass rules
# -----------------------------------------------------------------------------------


def evaluate_job(desc: JobDescription | None, unreachable: str = "") -> list[CheckResult]:
    """The job's own checks: agent present, its torch and backend, its spare pool, its redundancy.

    `desc` is None when the job did not answer `describe_job`: the agent check fails with
    `unreachable` and the checks that need the job's answer fail as not checked.
    """
    if desc is None:
        why = unreachable or "no answer"
        return [
            CheckResult(
                name=Check.AGENT, passed=False, detail=f"the job's agent did not answer: {why}"
            ),
            *(
                CheckResult(
                    name=n, passed=False, detail="not checked: the job's agent did not answer"
                )
                for n in (
                    Check.TORCH,
                    Check.BACKEND,
                    Check.SAME_STACK,
                    Check.SPARES,
                    Check.REDUNDANCY,
                )
            ),
        ]
    return [
        _agent(desc),
        _job_torch(desc),
        _backend(desc),
        _same_stack(desc),
        _spares(desc),
        _redundancy(desc),
    ]


def _agent(d: JobDescription) -> CheckResult:
    seen = (
        f"coordinator of {d.job_id} (torchpass {d.agent_version}, state {d.state}, generation "
        f"{d.generation}): {d.ranks_connected} of {d.world_size} rank slots held by a connected "
        "agent"
    )
    ok = d.ranks_connected == d.world_size and d.state == "training"
    if not ok:
        seen += "; every rank must run under the agent and the job must be training"
    if not d.live_migration:
        ok = False
        seen += (
            "; it runs without the agent (--no-agent): a failure restarts the whole job from the "
            "script's checkpoint and is never migrated live; run it under the agent "
            "(docs/adopting.md)"
        )
    return CheckResult(name=Check.AGENT, passed=ok, detail=seen)


def _ranks(env: RankEnvironment) -> str:
    return f"rank(s) {list(env.slots)}" if env.slots else "the job"


def _job_torch(d: JobDescription) -> CheckResult:
    envs = d.rank_environments()
    if not envs:
        return CheckResult(
            name=Check.TORCH, passed=False, detail="no rank has reported its torch yet"
        )
    verdicts = [(_torch_in_range(e.torch_version), e) for e in envs]
    detail = "; ".join(f"{_ranks(e)}: {why}" for (_, why), e in verdicts)
    return CheckResult(name=Check.TORCH, passed=all(ok for (ok, _), _ in verdicts), detail=detail)


def _backend_of(e: RankEnvironment) -> tuple[bool, str]:
    detail = (
        f"backend {e.backend}: {'available' if e.backend_available else 'NOT available'} in torch"
    )
    ok = e.backend_available
    if e.backend == "nccl":
        if e.nccl_version is None:
            ok, detail = False, detail + "; NCCL version unknown"
        else:
            detail += f", NCCL {e.nccl_version}"
    elif e.cuda_available:
        ok, detail = False, detail + "; CUDA is available, so the ranks must use nccl"
    return ok, detail


def _backend(d: JobDescription) -> CheckResult:
    envs = d.rank_environments()
    if not envs:
        return CheckResult(
            name=Check.BACKEND, passed=False, detail="no rank has reported its backend yet"
        )
    verdicts = [(_backend_of(e), e) for e in envs]
    detail = "; ".join(f"{_ranks(e)}: {why}" for (_, why), e in verdicts)
    return CheckResult(name=Check.BACKEND, passed=all(ok for (ok, _), _ in verdicts), detail=detail)


def _same_stack(d: JobDescription) -> CheckResult:
    """Every rank on one software stack: a node with another torch, CUDA, driver or NCCL than the
    rest is where a migrated rank would compute differently (or a collective fail)."""
    envs = d.rank_environments()
    if not envs:
        return CheckResult(
            name=Check.SAME_STACK, passed=False, detail="no rank has reported its stack yet"
        )
    stacks: dict[str, list[RankEnvironment]] = {}
    for e in envs:
        stacks.setdefault(e.stack(), []).append(e)
    if len(stacks) == 1:
        (stack,) = stacks
        return CheckResult(name=Check.SAME_STACK, passed=True, detail=f"every rank: {stack}")
    parts = [f"{stack} on {_where(es)}" for stack, es in sorted(stacks.items(), key=lambda i: i[0])]
    detail = f"the ranks' nodes differ: {'; '.join(parts)}"
    return CheckResult(name=Check.SAME_STACK, passed=False, detail=detail[:4000])


def _where(envs: list[RankEnvironment]) -> str:
    nodes = sorted({n for e in envs for n in e.nodes})
    slots = sorted(s for e in envs for s in e.slots)
    return f"node(s) {', '.join(nodes)} (rank(s) {slots})" if nodes else f"rank(s) {slots}"


def _spares(d: JobDescription) -> CheckResult:
    detail = f"{d.spares_ready} warm spare(s) ready, {d.spares_warming} warming"
    ok = d.spares_ready >= 1
    if not ok:
        detail += (
            "; an empty pool means no migration is possible (a disqualifying event), validate "
            "again once a spare is warm"
            if d.spares_warming
            else "; an empty pool means no migration is possible (a disqualifying event): run with "
            "--spares"
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
            f"; shard(s) {', '.join(low)} below {MIN_REDUNDANCY} replicas: a lost rank could not "
            "be rebuilt from a peer (failures exceeding parallelism redundancy are not covered)"
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
            name=Check.TEMPORAL,
            passed=False,
            detail=f"Temporal server did not answer: {f.temporal_error}",
        )
    if f.torch_version is None:
        torch = CheckResult(
            name=Check.CONTROL_TORCH,
            passed=False,
            detail=f"torch is not importable: {f.torch_error}",
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
    """Kubernetes or Slurm must be found; a local run is only waived (never passed) by the dev
    override."""
    found = [p for p in f.probes if p.found]
    seen = "; ".join(f"{p.scheduler}: {p.detail}" for p in f.probes) or "nothing probed"
    if found:
        names = " and ".join(p.scheduler for p in found)
        return CheckResult(
            name=Check.SCHEDULER, passed=True, detail=f"{names} detected ({seen})"[:4000]
        )
    if f.allow_local:
        return CheckResult(
            name=Check.SCHEDULER,
            status=CheckStatus.WAIVED,
            detail=(
                f"no Kubernetes or Slurm found ({seen}); WAIVED under the local-development "
                "override (allow_local, TORCHPASS_VALIDATION_ALLOW_LOCAL): a local run is not a "
                "TorchPass-supported environment, and a customer contract does not accept a waived "
                "check"
            )[:4000],
        )
    detail = (
        f"neither Kubernetes nor Slurm found ({seen}); TorchPass supports jobs under one of them"
    )
    return CheckResult(name=Check.SCHEDULER, passed=False, detail=detail[:4000])


def build_report(
    contract_id: str,
    job_id: str,
    checks: Sequence[CheckResult],
    at: datetime,
    source: str | None = None,
    job: JobDescription | None = None,
) -> ValidationReport:
    """The report: passed only when every check passed, passed with waivers when none failed. The
    job's key and its proof of holding it come from its description (`job`)."""
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
        job_key=job.key if job else None,
        job_proof=job.proof if job else None,
        job_endorsement=job.endorsement if job else None,
    )


def with_check(report: ValidationReport, check: CheckResult) -> ValidationReport:
    """The report with one more check (its verdict recomputed)."""
    rebuilt = build_report(
        report.contract_id, report.job_id, (*report.checks, check), report.validated_at
    )
    kept = ("source", "job_key", "job_proof", "job_endorsement")
    return rebuilt.model_copy(update={k: getattr(report, k) for k in kept})
