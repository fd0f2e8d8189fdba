"""EnvironmentValidationWorkflow: validate a job's environment for YOCO opt-in, record it on the
contract.

Three activities gather facts at once: the control plane (Temporal reachable, its torch and
backends) and the cluster scheduler on this workflow's own task queue, and `describe_job` on the
job's task queue, served by the worker inside the job's coordinator. A job that does not answer
within a short deadline is a failed `agent_present` check, not a failed workflow. Pure functions in
`torchpass.validation.checks` judge the facts.

The report is recorded through ContractWorkflow's `record_validation` *update*, run by an activity:
a workflow cannot send an update, and a signal would be neither acknowledged nor validated (the
contract refuses a report for a job that never opted in). When the contract is not running or
refuses the report, the returned report carries a failed `recorded_on_contract` check: nothing was
recorded, so the job is not covered.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import TypeVar

from temporalio import workflow
from temporalio.common import RawValue
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from torchpass.ids import (
        JobActivity,
        ValidationActivity,
        WorkflowName,
        contract_workflow_id,
        job_task_queue,
    )
    from torchpass.policies import DESCRIBE_ATTEMPT, VALIDATION_RETRY, VALIDATION_TIMEOUTS
    from torchpass.validation.checks import (
        build_report,
        evaluate_control_plane,
        evaluate_job,
        evaluate_scheduler,
        with_check,
    )
    from torchpass.validation.facts import (
        ControlPlaneFacts,
        JobDescription,
        SchedulerFacts,
        ValidationTarget,
    )
    from torchpass.validation.report import (
        Check,
        CheckResult,
        RecordValidationInput,
        RecordValidationResult,
        ValidateInput,
        ValidationReport,
    )
    from workflows.inputs import decode_start
    from workflows.logs import logger
    from workflows.policy import retry_policy

F = TypeVar("F")

RETRY_POLICY = retry_policy(VALIDATION_RETRY)


@workflow.defn(name=WorkflowName.VALIDATION)
class EnvironmentValidationWorkflow:
    @workflow.run
    async def run(self, start: RawValue) -> ValidationReport:
        inp = decode_start(start, ValidateInput)
        info = workflow.info()
        source = f"{info.workflow_id}/{info.run_id}"
        target = ValidationTarget(job_id=inp.job_id)
        # The job signs this run's id with its key: the contract registers the key only then.
        asked = ValidationTarget(job_id=inp.job_id, source=source)
        job_queue = inp.job_task_queue or job_task_queue(inp.job_id)
        job_deadline = (
            min(DESCRIBE_ATTEMPT, timedelta(seconds=inp.job_timeout_s)),
            timedelta(seconds=inp.job_timeout_s),
        )
        (control, control_err), (sched, sched_err), (job, job_err) = await asyncio.gather(
            _facts(ValidationActivity.CHECK_CONTROL_PLANE, target, ControlPlaneFacts),
            _facts(ValidationActivity.DETECT_SCHEDULER, target, SchedulerFacts),
            _facts(JobActivity.DESCRIBE_JOB, asked, JobDescription, job_queue, job_deadline),
        )
        checks: list[CheckResult] = []
        if control is None:
            why = f"not checked: {control_err}"
            checks += [
                CheckResult(name=Check.TEMPORAL, passed=False, detail=why),
                CheckResult(name=Check.CONTROL_TORCH, passed=False, detail=why),
            ]
        else:
            checks += evaluate_control_plane(control)
        if sched is None:
            checks.append(
                CheckResult(name=Check.SCHEDULER, passed=False, detail=f"not checked: {sched_err}")
            )
        else:
            # The override holds when the worker's settings or this request asks for it.
            checks.append(
                evaluate_scheduler(
                    sched.model_copy(update={"allow_local": sched.allow_local or inp.allow_local})
                )
            )
        checks += evaluate_job(job, job_err)
        report = build_report(inp.contract_id, inp.job_id, checks, workflow.now(), source, job)
        return await _record(inp, report)


async def _facts(
    name: str,
    target: ValidationTarget,
    result_type: type[F],
    queue: str | None = None,
    timeouts: tuple[timedelta, timedelta] | None = None,
) -> tuple[F | None, str]:
    """One fact-gathering activity; its failure past retries is a reason, never a failed
    workflow."""
    if timeouts is None:
        t = VALIDATION_TIMEOUTS[name]
        timeouts = (t.start_to_close, t.schedule_to_close)
    start_to_close, schedule_to_close = timeouts
    try:
        facts = await workflow.execute_activity(
            name,
            target,
            task_queue=queue,
            result_type=result_type,
            start_to_close_timeout=start_to_close,
            schedule_to_close_timeout=schedule_to_close,
            retry_policy=RETRY_POLICY,
        )
    except ActivityError as e:
        logger.warning("%s failed: %s", name, e.cause or e)
        return None, f"{name} failed: {e.cause or e}"
    return facts, ""


async def _record(inp: ValidateInput, report: ValidationReport) -> ValidationReport:
    """Record the report on its contract; when that fails, say so on the report that is returned."""
    t = VALIDATION_TIMEOUTS[ValidationActivity.RECORD_VALIDATION]
    try:
        result = await workflow.execute_activity(
            ValidationActivity.RECORD_VALIDATION,
            RecordValidationInput(customer_id=inp.customer_id, report=report),
            result_type=RecordValidationResult,
            start_to_close_timeout=t.start_to_close,
            schedule_to_close_timeout=t.schedule_to_close,
            retry_policy=RETRY_POLICY,
        )
    except ActivityError as e:
        result = RecordValidationResult(
            recorded=False, detail=f"could not reach the contract: {e.cause or e}"
        )
    if result.recorded:
        return report
    contract = contract_workflow_id(inp.customer_id, inp.contract_id)
    logger.warning("validation of %s not recorded on %s: %s", inp.job_id, contract, result.detail)
    return with_check(
        report,
        CheckResult(
            name=Check.RECORDED,
            passed=False,
            detail=f"not recorded on contract workflow {contract} ({result.detail}): the job is "
            "not covered until a validation is recorded on its running contract",
        ),
    )


VALIDATION_WORKFLOWS = [EnvironmentValidationWorkflow]
