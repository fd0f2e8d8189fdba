"""Environment validation of a real running job, recorded on a real ContractWorkflow.

The job is a real 4-rank gloo job with one warm spare (tests/integration/conftest.py) whose
coordinator's worker serves the real `describe_job`. EnvironmentValidationWorkflow, the real
control-side activities and the real ContractWorkflow run on a worker of this test against the real
dev server. No scheduler runs on this machine: the scheduler check is waived by the explicit
local-development override, which covers the job on a development contract only.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client
from temporalio.worker import Worker

from activities.ledger import LedgerActivities
from activities.validation import validation_activities
from activities.validation_settings import ValidationSettings
from job_agent import wire
from job_agent.coordinator.jobs import UnknownJob, request
from tests.integration.conftest import spec
from torchpass.contract.credit import Money
from torchpass.contract.rules import add_months
from torchpass.contract.terms import ContractPurpose, ContractTerms
from torchpass.ids import WorkflowName, job_task_queue
from torchpass.incident.attestation import JobKey
from torchpass.job import JobResult, JobState
from torchpass.validation.report import (
    Check,
    CheckStatus,
    ReportStatus,
    ValidateInput,
    ValidationReport,
)
from workers import contract_client as cc
from workers.job import run_job
from workflows.contract import CONTRACT_WORKFLOWS
from workflows.validation import VALIDATION_WORKFLOWS

pytestmark = pytest.mark.integration

# About 90 steps/s here: long enough to be validated while training, short enough to finish quickly.
ARGS = ("--steps", "1000", "--width", "32", "--depth", "1")


async def wait_until_training_with_a_warm_spare(
    state_dir: Path, job_id: str, task: asyncio.Task[JobResult]
) -> None:
    deadline = time.monotonic() + 90
    while True:
        assert time.monotonic() < deadline, "job never trained with a warm spare"
        assert not task.done(), "job ended before it was validated"
        try:
            st = await asyncio.to_thread(request, state_dir, job_id, wire.StatusRequest())
        except UnknownJob:  # not registered yet
            st = None
        if isinstance(st, wire.Status) and st.state is JobState.TRAINING and st.spares >= 1:
            return
        await asyncio.sleep(0.2)


async def validate(
    client: Client, queue: str, customer: str, contract_id: str, job_id: str
) -> ValidationReport:
    return await client.execute_workflow(
        WorkflowName.VALIDATION,
        ValidateInput(
            contract_id=contract_id,
            customer_id=customer,
            job_id=job_id,
            job_task_queue=job_task_queue(job_id),
        ),
        id=f"validate-{uuid.uuid4()}",
        task_queue=queue,
        execution_timeout=timedelta(seconds=60),
        result_type=ValidationReport,
    )


async def test_a_running_job_is_validated_and_recorded_on_its_contract(
    client: Client, tmp_path: Path
) -> None:
    # the cluster's enrolment key, its private half on this "job host"; the development contract
    # names its public half, so the job is covered there only as the coordinator vouches for its key
    enrolment = tmp_path / "enrolment.key"
    key = JobKey.generate()
    enrolment.write_text(key.private_hex())
    enrolment.chmod(0o600)
    job = spec(tmp_path, "validate-me", args=ARGS, enrolment_key_file=enrolment)
    queue, customer = f"validation-{uuid.uuid4()}", f"cust-{uuid.uuid4().hex[:8]}"
    today = datetime.now(UTC).date()
    terms = ContractTerms(
        customer_id=customer,
        contract_id="c-1",
        start=today,
        renewal_date=add_months(today, 12),
        annual_fee=Money(amount=Decimal("120000.00"), currency="USD"),
    )
    dev_terms = terms.model_copy(
        update={
            "contract_id": "c-dev",
            "purpose": ContractPurpose.DEVELOPMENT,
            "enrolment_key": key.public,
        }
    )
    ledger = LedgerActivities(client)  # the real checks: reports from the real validation workflow
    acts: list[Callable[..., Any]] = [
        *validation_activities(ValidationSettings(allow_local=True)),
        ledger.verify_outcomes,
        ledger.verify_validation,
    ]
    task = asyncio.create_task(run_job(job, client))
    try:
        async with Worker(
            client,
            task_queue=queue,
            workflows=[*VALIDATION_WORKFLOWS, *CONTRACT_WORKFLOWS],
            activities=acts,
        ):
            contract = await cc.create_contract(client, terms, task_queue=queue)
            dev_contract = await cc.create_contract(client, dev_terms, task_queue=queue)
            await cc.opt_in(client, customer, "c-1", job.job_id)
            await cc.opt_in(client, customer, "c-dev", job.job_id)
            await wait_until_training_with_a_warm_spare(tmp_path, job.job_id, task)
            report = await validate(client, queue, customer, "c-1", job.job_id)
            standing = await cc.get_standing(client, customer, "c-1")
            dev_report = await validate(client, queue, customer, "c-dev", job.job_id)
            dev_standing = await cc.get_standing(client, customer, "c-dev")
            unrecorded = await validate(
                client, queue, f"nobody-{uuid.uuid4().hex[:8]}", "c-1", job.job_id
            )
            await contract.terminate("test over")
            await dev_contract.terminate("test over")
    finally:
        result = await asyncio.wait_for(task, 120)
    assert result.ok, result.error

    checks = {c.name: c for c in report.checks}
    # Every check passed but the scheduler's, which was waived: not a pass.
    assert report.status is ReportStatus.PASSED_WITH_WAIVERS, [
        c for c in report.checks if not c.passed
    ]
    assert not report.passed and report.waived == (Check.SCHEDULER,)
    assert checks[Check.SCHEDULER].status is CheckStatus.WAIVED
    assert "4 of 4 rank slots" in checks[Check.AGENT].detail
    assert "1 warm spare(s) ready" in checks[Check.SPARES].detail
    # Measured: every rank reported holding the same shard (a digest of its parameters' structure).
    assert re.search(r"replicas per shard \{[0-9a-f]{16}: 4\}", checks[Check.REDUNDANCY].detail)
    assert "gloo: available" in checks[Check.BACKEND].detail
    assert checks[Check.SAME_STACK].passed, checks[Check.SAME_STACK]
    assert "server 1." in checks[Check.TEMPORAL].detail
    # A customer contract does not accept a waived check; a development contract does.
    assert standing.covered_jobs == ()
    assert dev_report.status is ReportStatus.PASSED_WITH_WAIVERS and dev_report.waived == (
        Check.SCHEDULER,
    )
    assert (
        dev_standing.covered_jobs == (job.job_id,)
        and dev_standing.purpose is ContractPurpose.DEVELOPMENT
    )
    assert dev_report.job_key is not None and dev_report.job_endorsement is not None

    assert not unrecorded.passed
    assert [c.name for c in unrecorded.checks if c.status is CheckStatus.FAILED] == [Check.RECORDED]
    assert unrecorded.status is ReportStatus.FAILED
    assert "no running contract" in unrecorded.checks[-1].detail
