"""EnvironmentValidationWorkflow on the time-skipping server, every activity mocked under its real
name.

The control-side activities (facts, and recording on the contract) are served on the workflow's
queue, `describe_job` on a per-test job queue, or not at all: an unreachable job. A waived scheduler
check is recorded by the real `record_validation` activity on real ContractWorkflows, a customer and
a development one; the real recording of a real job runs in tests/integration/test_validation.py.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any

from temporalio import activity
from temporalio.client import WorkflowHandle
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Replayer, Worker

from activities.ledger import LedgerActivities
from activities.validation import ValidationActivities
from activities.validation_settings import ValidationSettings
from tests.unit.test_validation import desc
from tests.workflows.test_contract import trust_outcomes
from torchpass.contract.credit import Money
from torchpass.contract.entries import EntryStatus
from torchpass.contract.rules import add_months
from torchpass.contract.terms import ContractPurpose, ContractTerms
from torchpass.errors import ErrorType
from torchpass.ids import JobActivity, ValidationActivity, WorkflowName
from torchpass.incident.attestation import JobKey
from torchpass.incident.outcome import MigrationOutcome
from torchpass.models import Category, Classification, Disposition, FailureKind
from torchpass.validation.facts import (
    ControlPlaneFacts,
    JobDescription,
    SchedulerFacts,
    SchedulerProbe,
    ValidationTarget,
)
from torchpass.validation.report import (
    Check,
    CheckStatus,
    RecordValidationInput,
    RecordValidationResult,
    ReportStatus,
    ValidateInput,
    ValidationReport,
)
from workers import contract_client as cc
from workflows.contract import CONTRACT_WORKFLOWS
from workflows.validation import VALIDATION_WORKFLOWS, EnvironmentValidationWorkflow

JOB_KEY = JobKey.generate()  # the job's own: it proves it holds it to each validation
ALL_CHECKS = [
    Check.TEMPORAL,
    Check.CONTROL_TORCH,
    Check.SCHEDULER,
    Check.AGENT,
    Check.TORCH,
    Check.BACKEND,
    Check.SAME_STACK,
    Check.SPARES,
    Check.REDUNDANCY,
]


def job(**kw: Any) -> JobDescription:
    return desc(**{"job_id": "job-1", **kw})


class Fakes:
    """The validation activities, scripted; `recorded` holds what the fake contract was given."""

    def __init__(
        self,
        description: JobDescription | None = None,
        scheduler: str = "slurm",  # "slurm", "none" or "crash"
        wrong_job: bool = False,
        contract: str = "running",  # "running", "missing" or "unreachable"
    ) -> None:
        self.description = description or job()
        self.scheduler = scheduler
        self.wrong_job = wrong_job
        self.contract = contract
        self.calls: Counter[str] = Counter()
        self.recorded: list[RecordValidationInput] = []

    def control(self) -> list[Any]:
        @activity.defn(name=ValidationActivity.CHECK_CONTROL_PLANE)
        async def check_control_plane(inp: ValidationTarget) -> ControlPlaneFacts:
            self.calls["control"] += 1
            return ControlPlaneFacts(
                task_queue=activity.info().task_queue,
                namespace="default",
                temporal_server_version="1.32.0",
                torch_version="2.13.0+cpu",
                gloo_available=True,
            )

        @activity.defn(name=ValidationActivity.DETECT_SCHEDULER)
        async def detect_scheduler(inp: ValidationTarget) -> SchedulerFacts:
            self.calls["scheduler"] += 1
            if self.scheduler == "crash":
                raise ApplicationError("scontrol crashed")
            found = self.scheduler == "slurm"
            probe = SchedulerProbe(
                scheduler="slurm", found=found, detail="Slurmctld(primary) at c1 is UP"
            )
            return SchedulerFacts(probes=(probe,))

        @activity.defn(name=ValidationActivity.RECORD_VALIDATION)
        async def record_validation(inp: RecordValidationInput) -> RecordValidationResult:
            self.calls["record"] += 1
            if self.contract == "unreachable":
                raise ApplicationError("UNAVAILABLE: no Temporal server")
            if self.contract == "missing":
                return RecordValidationResult(recorded=False, detail="no running contract: c-1")
            self.recorded.append(inp)
            return RecordValidationResult(recorded=True, detail="job job-1 now success")

        return [check_control_plane, detect_scheduler, record_validation]

    def job_side(self) -> list[Any]:
        @activity.defn(name=JobActivity.DESCRIBE_JOB)
        async def describe_job(inp: ValidationTarget) -> JobDescription:
            self.calls["describe"] += 1
            if self.wrong_job:
                raise ApplicationError(
                    "this is job other", type=ErrorType.INVALID_INPUT, non_retryable=True
                )
            if inp.source is None:
                return self.description
            proof = JOB_KEY.prove(inp.job_id, inp.source)
            return self.description.model_copy(update={"key": JOB_KEY.public, "proof": proof})

        return [describe_job]


@asynccontextmanager
async def workers(
    env: WorkflowEnvironment, fakes: Fakes, job_served: bool = True
) -> AsyncIterator[tuple[str, str]]:
    queue, job_queue = f"control-{uuid.uuid4()}", f"job-{uuid.uuid4()}"
    async with Worker(
        env.client, task_queue=queue, workflows=VALIDATION_WORKFLOWS, activities=fakes.control()
    ):
        if job_served:
            async with Worker(env.client, task_queue=job_queue, activities=fakes.job_side()):
                yield queue, job_queue
        else:
            yield queue, job_queue


async def validate(
    env: WorkflowEnvironment, fakes: Fakes, job_served: bool = True, allow_local: bool = False
) -> tuple[ValidationReport, WorkflowHandle[Any, Any]]:
    async with workers(env, fakes, job_served) as (queue, job_queue):
        handle = await env.client.start_workflow(
            WorkflowName.VALIDATION,
            # A short deadline for the job's answer: an activity nobody polls holds the time
            # skipping back.
            ValidateInput(
                contract_id="c-1",
                customer_id="acme",
                job_id="job-1",
                job_task_queue=job_queue,
                job_timeout_s=2,
                allow_local=allow_local,
            ),
            id=f"validate-{uuid.uuid4()}",
            task_queue=queue,
            result_type=ValidationReport,
        )
        return await handle.result(), handle


def names(report: ValidationReport, passed: bool) -> list[str]:
    return [c.name for c in report.checks if c.passed is passed]


async def test_a_valid_environment_passes_and_is_recorded_on_the_contract(
    env: WorkflowEnvironment,
) -> None:
    fakes = Fakes()
    report, handle = await validate(env, fakes)
    assert report.passed, report.checks
    assert names(report, True) == ALL_CHECKS
    assert [(r.customer_id, r.report) for r in fakes.recorded] == [("acme", report)]
    assert fakes.calls == {"control": 1, "scheduler": 1, "describe": 1, "record": 1}
    # Deterministic: the history replays against the workflow's code.
    replayer = Replayer(
        workflows=[EnvironmentValidationWorkflow], data_converter=pydantic_data_converter
    )
    assert (await replayer.replay_workflow(await handle.fetch_history())).replay_failure is None


async def test_an_empty_spare_pool_and_no_redundancy_fail_and_are_recorded(
    env: WorkflowEnvironment,
) -> None:
    fakes = Fakes(job(world_size=1, ranks_connected=1, spares_ready=0, shard_replicas={"model": 1}))
    report, _ = await validate(env, fakes)
    assert not report.passed
    assert names(report, False) == [Check.SPARES, Check.REDUNDANCY]
    assert [r.report for r in fakes.recorded] == [report]  # a failed validation is recorded too


async def test_an_unreachable_job_fails_agent_present_not_the_workflow(
    env: WorkflowEnvironment,
) -> None:
    fakes = Fakes()
    report, _ = await validate(env, fakes, job_served=False)
    assert not report.passed
    agent = next(c for c in report.checks if c.name == Check.AGENT)
    assert "did not answer" in agent.detail and "timeout" in agent.detail.lower()
    assert names(report, False) == [
        Check.AGENT,
        Check.TORCH,
        Check.BACKEND,
        Check.SAME_STACK,
        Check.SPARES,
        Check.REDUNDANCY,
    ]
    assert fakes.calls["describe"] == 0 and [r.report for r in fakes.recorded] == [report]


async def test_a_failing_check_activity_is_a_failed_check(env: WorkflowEnvironment) -> None:
    fakes = Fakes(scheduler="crash")
    report, _ = await validate(env, fakes)
    assert names(report, False) == [Check.SCHEDULER]
    assert "scontrol crashed" in report.checks[2].detail
    assert fakes.calls["scheduler"] == 3  # retried, then judged


async def test_a_job_queue_of_another_job_is_not_retried(env: WorkflowEnvironment) -> None:
    fakes = Fakes(wrong_job=True)
    report, _ = await validate(env, fakes)
    assert Check.AGENT in names(report, False) and fakes.calls["describe"] == 1


async def test_no_scheduler_fails_unless_the_request_waives_it(env: WorkflowEnvironment) -> None:
    report, _ = await validate(env, Fakes(scheduler="none"))
    assert names(report, False) == [Check.SCHEDULER] and report.status is ReportStatus.FAILED
    report, _ = await validate(env, Fakes(scheduler="none"), allow_local=True)
    assert not report.passed and report.status is ReportStatus.PASSED_WITH_WAIVERS
    assert report.waived == (Check.SCHEDULER,) and report.checks[2].status is CheckStatus.WAIVED
    assert "local-development override" in report.checks[2].detail


async def test_a_waived_check_covers_the_job_on_a_development_contract_only(
    env: WorkflowEnvironment,
) -> None:
    """The scheduler check waived (allow_local), recorded by the real activity on real contracts."""
    fakes = Fakes(scheduler="none")
    queue, job_queue = f"control-{uuid.uuid4()}", f"job-{uuid.uuid4()}"
    record = ValidationActivities(ValidationSettings(allow_local=False)).record_validation
    # Waiting on a validation's result would skip time to the contracts' renewal timers.
    with env.auto_time_skipping_disabled():
        async with (
            Worker(
                env.client,
                task_queue=queue,
                workflows=[*VALIDATION_WORKFLOWS, *CONTRACT_WORKFLOWS],
                # The report is checked for real; the outcome, made up here, is taken on trust.
                activities=[
                    *fakes.control()[:2],
                    record,
                    LedgerActivities(env.client).verify_validation,
                    trust_outcomes,
                ],
            ),
            Worker(env.client, task_queue=job_queue, activities=fakes.job_side()),
        ):
            customer = await _validate_waived(env, ContractPurpose.CUSTOMER, queue, job_queue)
            development = await _validate_waived(env, ContractPurpose.DEVELOPMENT, queue, job_queue)
    assert customer == ((), 0, EntryStatus.VALIDATION_WAIVED, ContractPurpose.CUSTOMER)
    assert development == (("job-1",), 1, EntryStatus.SUCCESS, ContractPurpose.DEVELOPMENT)


async def _validate_waived(
    env: WorkflowEnvironment, purpose: ContractPurpose, queue: str, job_queue: str
) -> tuple[object, ...]:
    """A contract of `purpose`, job-1 validated with the scheduler waived and one outcome recorded:
    its covered jobs, qualifying count, the outcome's ledger status and the ledger's purpose."""
    cid, today = f"c-{purpose.value}-{uuid.uuid4().hex[:6]}", (await env.get_current_time()).date()
    terms = ContractTerms(
        customer_id="acme",
        contract_id=cid,
        start=today,
        renewal_date=add_months(today, 12),
        annual_fee=Money(amount="120000", currency="USD"),
        purpose=purpose,
    )
    contract = await cc.create_contract(env.client, terms, task_queue=queue)
    await cc.opt_in(env.client, "acme", cid, "job-1")
    inp = ValidateInput(
        contract_id=cid,
        customer_id="acme",
        job_id="job-1",
        job_task_queue=job_queue,
        job_timeout_s=2,
        allow_local=True,
    )
    report = await env.client.execute_workflow(
        WorkflowName.VALIDATION,
        inp,
        id=f"validate-{uuid.uuid4()}",
        task_queue=queue,
        result_type=ValidationReport,
    )
    # Recorded either way (no failed recorded_on_contract check): the verdict is the contract's.
    assert report.status is ReportStatus.PASSED_WITH_WAIVERS and report.waived == (Check.SCHEDULER,)
    await cc.record_outcome(env.client, "acme", cid, outcome(await env.get_current_time()))
    for _ in range(200):  # counted once checked
        standing = await cc.get_standing(env.client, "acme", cid)
        if standing.unverified == 0:
            break
        await asyncio.sleep(0.05)
    ledger = await cc.get_ledger(env.client, "acme", cid)
    await contract.terminate("test done")
    (row,) = ledger.rows
    return standing.covered_jobs, standing.qualifying, row.status, ledger.purpose


def outcome(at: datetime) -> MigrationOutcome:
    return MigrationOutcome(
        incident_id=f"torchpass-incident-job-1-node-1-g1/{uuid.uuid4()}",
        job_id="job-1",
        failure_domain="node-1",
        kind=FailureKind.PROCESS_EXIT,
        evidence_count=1,
        classification=Classification(
            category=Category.INTERRUPTION, qualifying=True, reason="exit"
        ),
        covered=True,
        disposition=Disposition.MIGRATED,
        success=True,
        detected_at=at,
    )


async def test_a_contract_that_is_not_running_is_reported(env: WorkflowEnvironment) -> None:
    report, _ = await validate(env, Fakes(contract="missing"))
    assert not report.passed
    assert names(report, False) == [Check.RECORDED]
    assert (
        "no running contract" in report.checks[-1].detail
        and "not covered" in report.checks[-1].detail
    )


async def test_a_contract_that_cannot_be_reached_is_reported_after_retries(
    env: WorkflowEnvironment,
) -> None:
    fakes = Fakes(contract="unreachable")
    report, _ = await validate(env, fakes)
    assert names(report, False) == [Check.RECORDED] and fakes.calls["record"] == 3
    assert "UNAVAILABLE" in report.checks[-1].detail
