"""Only the job's own word moves money. Three forgeries from the field, each needing nothing but
Temporal access, and the genuine job beside them:

- torchpass's own MigrationWorkflow started for a covered job with its job queue pointing elsewhere:
  at a worker the attacker runs, which answers every step with a made-up live migration signed
  with a key of its own, and at a queue where nothing answers. The genuine workflow code records
  both, but the job never signed them: unconfirmed, never qualifying.
- a workflow typed EnvironmentValidationWorkflow, the genuine code even, run by the attacker's own
  worker on its own queue, recording an all-passed validation (with a key of the attacker's): the
  contract refuses it, so a job that never existed is never covered.
- the genuine job's incident, signed with the key its genuine validation registered: counted.

The real ContractWorkflow, MigrationWorkflow, EnvironmentValidationWorkflow, ledger checks and
`record_validation` activity on the time-skipping server; the jobs are FakeJobs with keys.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from activities.control import ControlActivities
from activities.ledger import LedgerActivities
from activities.validation import ValidationActivities
from activities.validation_settings import ValidationSettings
from tests.workflows.fake_job import FakeJob, report, signal_with_start
from tests.workflows.test_validation_workflow import JOB_KEY, Fakes, job
from torchpass.contract.credit import Money
from torchpass.contract.entries import EntryStatus
from torchpass.contract.rules import add_months
from torchpass.contract.terms import ContractTerms
from torchpass.ids import CONTROL_TASK_QUEUE, WorkflowName
from torchpass.incident.attestation import JobKey
from torchpass.incident.outcome import MigrationOutcome
from torchpass.models import ContractRef
from torchpass.validation.report import ValidateInput, ValidationReport
from workers import contract_client as cc
from workflows.contract import CONTRACT_WORKFLOWS
from workflows.migration import MigrationWorkflow
from workflows.validation import VALIDATION_WORKFLOWS

CUSTOMER = "acme"


@asynccontextmanager
async def control(env: WorkflowEnvironment) -> AsyncIterator[None]:
    """The control worker: every workflow and the control-side activities, on its own queue (the
    control plane's and scheduler's facts scripted, the rest real)."""
    ledger = LedgerActivities(env.client)
    record = ValidationActivities(ValidationSettings()).record_validation
    async with Worker(
        env.client,
        task_queue=CONTROL_TASK_QUEUE,
        workflows=[MigrationWorkflow, *CONTRACT_WORKFLOWS, *VALIDATION_WORKFLOWS],
        activities=[
            ControlActivities().classify_failure,
            ledger.verify_outcomes,
            ledger.verify_validation,
            *Fakes().control()[:2],
            record,
        ],
    ):
        yield


async def contract(env: WorkflowEnvironment, enrolment_key: str | None = None) -> ContractRef:
    ref = ContractRef(customer_id=CUSTOMER, contract_id=f"c-{uuid.uuid4().hex[:8]}")
    today = (await env.get_current_time()).date()
    terms = ContractTerms(
        customer_id=CUSTOMER,
        contract_id=ref.contract_id,
        start=today,
        renewal_date=add_months(today, 12),
        annual_fee=Money(amount="120000", currency="USD"),
        enrolment_key=enrolment_key,
    )
    await cc.create_contract(env.client, terms)
    return ref


async def validate(
    client: Client, ref: ContractRef, job_id: str, job_queue: str, queue: str
) -> ValidationReport:
    """A validation of `job_id` (answered on `job_queue`), run on `queue`."""
    inp = ValidateInput(
        contract_id=ref.contract_id,
        customer_id=CUSTOMER,
        job_id=job_id,
        job_task_queue=job_queue,
        job_timeout_s=2,
    )
    return await client.execute_workflow(
        WorkflowName.VALIDATION,
        inp,
        id=f"validate-{uuid.uuid4()}",
        task_queue=queue,
        result_type=ValidationReport,
    )


async def incident(
    env: WorkflowEnvironment, ref: ContractRef, job_id: str, generation: int, side: FakeJob | None
) -> MigrationOutcome:
    """One MigrationWorkflow of `job_id`, its job queue served by `side` (None: by nobody)."""
    rep = report(job_id, contract=ref, at=await env.get_current_time())
    queue = f"{rep.job_task_queue}-{uuid.uuid4().hex[:6]}"
    rep = rep.model_copy(update={"generation": generation, "job_task_queue": queue})
    handle = await signal_with_start(env, rep)
    if side is None:
        result: MigrationOutcome = await handle.result()
        return result
    async with Worker(env.client, task_queue=queue, activities=side.activities()):
        result = await handle.result()
    return result


async def checked(env: WorkflowEnvironment, ref: ContractRef) -> cc.Standing:
    for _ in range(400):
        s = await cc.get_standing(env.client, ref.customer_id, ref.contract_id)
        if s.unverified == 0:
            return s
        await asyncio.sleep(0.05)
    raise AssertionError("outcomes never checked")


async def test_outcomes_count_only_with_the_jobs_signature(env: WorkflowEnvironment) -> None:
    job_id = f"job-{uuid.uuid4().hex[:8]}"
    genuine_job, attacker = FakeJob(), FakeJob()
    genuine_job.key = JOB_KEY  # the key the job proves it holds to its validation
    attacker.key = JobKey.generate()
    silent = FakeJob(gone=True)  # answers nothing: the attestation never comes
    job_queue = f"describe-{uuid.uuid4().hex[:6]}"
    fakes = Fakes(description=job(job_id=job_id))
    with env.auto_time_skipping_disabled():
        async with (
            control(env),
            Worker(env.client, task_queue=job_queue, activities=fakes.job_side()),
        ):
            ref = await contract(env)
            await cc.opt_in(env.client, CUSTOMER, ref.contract_id, job_id)
            validated = await validate(env.client, ref, job_id, job_queue, CONTROL_TASK_QUEUE)
            genuine = await incident(env, ref, job_id, 0, genuine_job)
            forged = [
                await incident(env, ref, job_id, 1, attacker),
                await incident(env, ref, job_id, 2, silent),
            ]
            standing = await checked(env, ref)
            page = await cc.get_ledger(env.client, CUSTOMER, ref.contract_id)
    assert validated.passed and validated.job_key == JOB_KEY.public, validated
    assert genuine.success and genuine.attestation is not None
    assert forged[0].success and forged[0].attestation is not None  # the attacker's own key
    assert forged[1].attestation is None and "not attested by the job" in (forged[1].error or "")
    rows = {r.incident_id: r for r in page.rows}
    assert rows[genuine.incident_id].status is EntryStatus.SUCCESS
    for o in forged:
        assert rows[o.incident_id].status is EntryStatus.UNCONFIRMED, rows[o.incident_id]
        assert not rows[o.incident_id].counted
    assert standing.qualifying == 1 and standing.successful == 1


async def test_a_validation_run_off_the_control_queue_covers_nothing(
    env: WorkflowEnvironment,
) -> None:
    """The attacker's worker runs the validation workflow's own code on its own queue, for a job of
    its making that proves a key of its own; its outcomes, signed with that key, would follow. The
    contract refuses the validation: the job is never covered, no key is registered."""
    job_id = f"job-never-existed-{uuid.uuid4().hex[:6]}"
    own_queue, job_queue = f"attacker-{uuid.uuid4().hex[:6]}", f"attacker-job-{uuid.uuid4()}"
    fakes = Fakes(description=job(job_id=job_id))
    record = ValidationActivities(ValidationSettings()).record_validation
    with env.auto_time_skipping_disabled():
        async with (
            control(env),
            Worker(
                env.client,
                task_queue=own_queue,
                workflows=VALIDATION_WORKFLOWS,
                activities=[*fakes.control()[:2], record],
            ),
            Worker(env.client, task_queue=job_queue, activities=fakes.job_side()),
        ):
            ref = await contract(env)
            await cc.opt_in(env.client, CUSTOMER, ref.contract_id, job_id)
            made: Any = await validate(env.client, ref, job_id, job_queue, own_queue)
            standing = await checked(env, ref)
            page = await cc.get_ledger(env.client, CUSTOMER, ref.contract_id)
    assert made.job_key is not None and not made.passed  # the report says it was not recorded
    assert "not on the control worker's" in page.rejected[-1].reason, page.rejected
    assert standing.covered_jobs == ()


async def test_a_made_up_job_served_to_a_genuine_validation_needs_the_clusters_enrolment_key(
    env: WorkflowEnvironment,
) -> None:
    """What Temporal access alone can still do on a contract that names no enrolment key: serve a
    job queue of one's own to a genuine validation (on the control queue), the made-up job proving
    a key of its own. A contract that names the cluster's enrolment key refuses it; the genuine job,
    its key vouched for by the enrolment key its host holds, is covered."""
    enrolment = JobKey.generate()  # its private half only on the customer's job hosts
    made_up, genuine_id = f"job-made-up-{uuid.uuid4().hex[:6]}", f"job-{uuid.uuid4().hex[:6]}"
    fake_queue, real_queue = f"fake-{uuid.uuid4().hex[:6]}", f"real-{uuid.uuid4().hex[:6]}"
    fake = Fakes(description=job(job_id=made_up))  # a key and proof of its own, no endorsement
    vouched = enrolment.endorse(genuine_id, JOB_KEY.public)
    real = Fakes(description=job(job_id=genuine_id, endorsement=vouched))
    with env.auto_time_skipping_disabled():
        async with (
            control(env),
            Worker(env.client, task_queue=fake_queue, activities=fake.job_side()),
            Worker(env.client, task_queue=real_queue, activities=real.job_side()),
        ):
            open_ref = await contract(env)
            closed_ref = await contract(env, enrolment.public)
            results = []
            for ref in (open_ref, closed_ref):
                await cc.opt_in(env.client, CUSTOMER, ref.contract_id, made_up)
                results.append(
                    await validate(env.client, ref, made_up, fake_queue, CONTROL_TASK_QUEUE)
                )
            await cc.opt_in(env.client, CUSTOMER, closed_ref.contract_id, genuine_id)
            genuine = await validate(
                env.client, closed_ref, genuine_id, real_queue, CONTROL_TASK_QUEUE
            )
            open_standing = await checked(env, open_ref)
            closed_standing = await checked(env, closed_ref)
            page = await cc.get_ledger(env.client, CUSTOMER, closed_ref.contract_id)
    assert results[0].passed and open_standing.covered_jobs == (made_up,)  # the open row
    assert not results[1].passed and made_up not in closed_standing.covered_jobs
    assert "not vouched for by the contract's enrolment key" in page.rejected[-1].reason
    assert genuine.passed and closed_standing.covered_jobs == (genuine_id,)
