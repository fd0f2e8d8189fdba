"""EnvironmentValidationWorkflow on the time-skipping server, every activity mocked under its real name.

The control-side activities (facts, and recording on the contract) are served on the workflow's queue,
`describe_job` on a per-test job queue, or not at all: an unreachable job. The real recording against the
real ContractWorkflow runs in tests/integration/test_validation.py.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from temporalio import activity
from temporalio.client import WorkflowHandle
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Replayer, Worker

from tests.unit.test_validation import desc
from torchpass.errors import ErrorType
from torchpass.ids import JobActivity, ValidationActivity
from torchpass.validation import (
    Check,
    ControlPlaneFacts,
    JobDescription,
    RecordValidationInput,
    RecordValidationResult,
    SchedulerFacts,
    SchedulerProbe,
    ValidateInput,
    ValidationReport,
    ValidationTarget,
)
from workflows.validation import VALIDATION_WORKFLOWS, EnvironmentValidationWorkflow

ALL_CHECKS = [
    Check.TEMPORAL,
    Check.CONTROL_TORCH,
    Check.SCHEDULER,
    Check.AGENT,
    Check.TORCH,
    Check.BACKEND,
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
            probe = SchedulerProbe(scheduler="slurm", found=found, detail="Slurmctld(primary) at c1 is UP")
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
                raise ApplicationError("this is job other", type=ErrorType.INVALID_INPUT, non_retryable=True)
            return self.description

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
            EnvironmentValidationWorkflow.run,
            # A short deadline for the job's answer: an activity nobody polls holds the time skipping back.
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
        )
        return await handle.result(), handle


def names(report: ValidationReport, passed: bool) -> list[str]:
    return [c.name for c in report.checks if c.passed is passed]


async def test_a_valid_environment_passes_and_is_recorded_on_the_contract(env: WorkflowEnvironment) -> None:
    fakes = Fakes()
    report, handle = await validate(env, fakes)
    assert report.passed, report.checks
    assert names(report, True) == ALL_CHECKS
    assert [(r.customer_id, r.report) for r in fakes.recorded] == [("acme", report)]
    assert fakes.calls == {"control": 1, "scheduler": 1, "describe": 1, "record": 1}
    # Deterministic: the history replays against the workflow's code.
    replayer = Replayer(workflows=[EnvironmentValidationWorkflow], data_converter=pydantic_data_converter)
    assert (await replayer.replay_workflow(await handle.fetch_history())).replay_failure is None


async def test_an_empty_spare_pool_and_no_redundancy_fail_and_are_recorded(env: WorkflowEnvironment) -> None:
    fakes = Fakes(job(world_size=1, ranks_connected=1, spares_ready=0, shard_replicas={"model": 1}))
    report, _ = await validate(env, fakes)
    assert not report.passed
    assert names(report, False) == [Check.SPARES, Check.REDUNDANCY]
    assert [r.report for r in fakes.recorded] == [report]  # a failed validation is recorded too


async def test_an_unreachable_job_fails_agent_present_not_the_workflow(env: WorkflowEnvironment) -> None:
    fakes = Fakes()
    report, _ = await validate(env, fakes, job_served=False)
    assert not report.passed
    agent = next(c for c in report.checks if c.name == Check.AGENT)
    assert "did not answer" in agent.detail and "timeout" in agent.detail.lower()
    assert names(report, False) == [Check.AGENT, Check.TORCH, Check.BACKEND, Check.SPARES, Check.REDUNDANCY]
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


async def test_no_scheduler_fails_unless_the_request_allows_a_local_run(env: WorkflowEnvironment) -> None:
    report, _ = await validate(env, Fakes(scheduler="none"))
    assert names(report, False) == [Check.SCHEDULER]
    report, _ = await validate(env, Fakes(scheduler="none"), allow_local=True)
    assert report.passed and "local-development override" in report.checks[2].detail


async def test_a_contract_that_is_not_running_is_reported(env: WorkflowEnvironment) -> None:
    report, _ = await validate(env, Fakes(contract="missing"))
    assert not report.passed
    assert names(report, False) == [Check.RECORDED]
    assert "no running contract" in report.checks[-1].detail and "not covered" in report.checks[-1].detail


async def test_a_contract_that_cannot_be_reached_is_reported_after_retries(env: WorkflowEnvironment) -> None:
    fakes = Fakes(contract="unreachable")
    report, _ = await validate(env, fakes)
    assert names(report, False) == [Check.RECORDED] and fakes.calls["record"] == 3
    assert "UNAVAILABLE" in report.checks[-1].detail
