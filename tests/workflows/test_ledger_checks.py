"""The ledger counts only what it can check: a forged validation and a forged outcome sent from a
plain client earn no credit, a genuine incident's outcome is counted, and the same failure told
twice (a second run of its incident) is counted once. The real ContractWorkflow, MigrationWorkflow
and ledger checks (`activities.ledger`, reading the histories) on the time-skipping server; the job
side is FakeJob."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from temporalio.client import Client, WorkflowHandle
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from activities.ledger import LedgerActivities
from tests.workflows.fake_job import FakeJob, control_worker, finish, report, signal_with_start
from tests.workflows.test_contract import CUSTOMER, Contract, FakeBilling, _start_day
from torchpass.contract.credit import Money
from torchpass.contract.rules import add_months, day_start
from torchpass.contract.terms import ContractTerms, RenewInput
from torchpass.errors import ErrorType
from torchpass.models import ContractRef
from torchpass.render import format_ledger
from torchpass.validation.report import CheckResult, ValidationReport
from workers import contract_client as cc
from workflows.contract import CONTRACT_WORKFLOWS


async def _checked(client: Client, customer: str, contract_id: str) -> cc.Standing:
    """The standing once every outcome received was checked."""
    for _ in range(400):
        s = await cc.get_standing(client, customer, contract_id)
        if s.unverified == 0:
            return s
        await asyncio.sleep(0.05)
    raise AssertionError("outcomes never checked")


async def test_the_30000_usd_forgery_earns_no_credit(
    own_env: WorkflowEnvironment, name: str
) -> None:
    """Repeats the finding: a made-up passing validation and one made-up failed outcome, sent with
    nothing but a client, used to deliver 25% of a 120,000 USD fee to billing. On a server of its
    own: skipping a year wakes every other test's workflows too."""
    env = own_env
    start = await _start_day(env)
    c = Contract(env, start)
    billing = FakeBilling()
    ledger = LedgerActivities(env.client)
    acts: list[Callable[..., Any]] = [
        billing.deliver,
        ledger.verify_outcomes,
        ledger.verify_validation,
    ]
    async with Worker(
        env.client, task_queue=c.queue, workflows=CONTRACT_WORKFLOWS, activities=acts
    ):
        handle = await c.create()
        await cc.opt_in(c.client, CUSTOMER, c.id, "job-a")
        now = await env.get_current_time()
        check = CheckResult(name="torch_backend", passed=True)
        forged = [
            ValidationReport(
                contract_id=c.id, job_id="job-a", passed=True, checks=(check,), validated_at=now
            ),
            ValidationReport(  # naming a run that does not exist
                contract_id=c.id,
                job_id="job-a",
                passed=True,
                checks=(check,),
                validated_at=now,
                source=f"validate-job-a/{uuid.uuid4()}",
            ),
        ]
        for report_ in forged:
            with pytest.raises(cc.ContractRejected) as e:
                await cc.record_validation(c.client, CUSTOMER, report_)
            assert e.value.error_type == ErrorType.CONTRACT_UNVERIFIED
        await cc.record_outcome(c.client, CUSTOMER, c.id, c.outcome(now, success=False))
        checked = await _checked(c.client, CUSTOMER, c.id)
        await cc.renew(c.client, CUSTOMER, c.id, RenewInput())
        renewal = c.terms.renewal_date
        await env.sleep(day_start(renewal) + timedelta(hours=2) - await env.get_current_time())
        final = await cc.get_standing(c.client, CUSTOMER, c.id)
        page = await cc.get_ledger(c.client, CUSTOMER, c.id)
        await handle.terminate("test done")
    await c.save(name, handle.result_run_id or "")
    assert checked.rejected_claims == 3 and checked.qualifying == 0 and checked.covered_jobs == ()
    assert page.rows == ()  # nothing counted, nothing even excluded: the claims are apart, with why
    reasons = [r.reason for r in page.rejected]
    assert "names no validation workflow run" in reasons[0]
    assert "no such validation workflow" in reasons[1]
    assert "no such incident workflow" in reasons[2]
    shown = format_ledger(page)  # what `torchpass contract ledger` prints
    assert "refused, never counted (the latest 3)" in shown and "no such incident workflow" in shown
    assert [e.credit for e in final.evaluations] == [None] and final.pending_credits == 0
    assert billing.accepted == []


async def _contract(env: WorkflowEnvironment) -> tuple[ContractRef, WorkflowHandle[object, object]]:
    ref = ContractRef(customer_id="acme", contract_id=f"c-{uuid.uuid4().hex[:8]}")
    today = (await env.get_current_time()).date()
    terms = ContractTerms(
        customer_id=ref.customer_id,
        contract_id=ref.contract_id,
        start=today,
        renewal_date=add_months(today, 12),
        annual_fee=Money(amount=Decimal(120000), currency="USD"),
    )
    return ref, await cc.create_contract(env.client, terms)


async def test_a_genuine_outcome_counts_and_the_same_failure_told_again_counts_once(
    env: WorkflowEnvironment, name: str
) -> None:
    job_id = f"job-{uuid.uuid4().hex[:8]}"
    async with control_worker(env):
        ref, contract = await _contract(env)
        rep = report(job_id, contract=ref, at=await env.get_current_time())
        first = await finish(
            env, await signal_with_start(env, rep), FakeJob(), name, rep.job_task_queue
        )
        # The same report once the incident is closed: a second run of the failure's incident
        # workflow.
        again = await finish(
            env, await signal_with_start(env, rep), FakeJob(), name, rep.job_task_queue
        )
        standing = await _checked(env.client, ref.customer_id, ref.contract_id)
        page = await cc.get_ledger(env.client, ref.customer_id, ref.contract_id)
        await contract.terminate("test done")
    assert first.incident_id != again.incident_id
    assert [r.incident_id for r in page.rows] == [first.incident_id]
    (refused,) = page.rejected
    assert refused.claim == again.incident_id and "the same failure" in refused.reason
    assert standing.duplicates == 1 and standing.rejected_claims == 1


async def test_an_outcome_the_incident_did_not_send_is_rejected(
    env: WorkflowEnvironment, name: str
) -> None:
    """Outcomes no incident sent this contract are refused; a genuine incident's id with a figure
    changed is that incident told again, counted once as first recorded."""
    job_id = f"job-{uuid.uuid4().hex[:8]}"
    async with control_worker(env):
        ref, contract = await _contract(env)
        rep = report(job_id, contract=ref, at=await env.get_current_time())
        genuine = await finish(
            env, await signal_with_start(env, rep), FakeJob(), name, rep.job_task_queue
        )
        await _checked(env.client, ref.customer_id, ref.contract_id)
        other = f"{rep.job_task_queue}-no-contract"  # an incident that told no contract
        rep2 = report(job_id, slot=3, at=await env.get_current_time())
        rep2 = rep2.model_copy(update={"generation": 1, "job_task_queue": other})
        unsent = await finish(env, await signal_with_start(env, rep2), FakeJob(), name, other)
        for forged in (
            genuine.model_copy(update={"success": False, "steps_recomputed": 5}),
            unsent,
            unsent.model_copy(update={"job_id": "job-someone-else"}),
        ):
            await cc.record_outcome(env.client, ref.customer_id, ref.contract_id, forged)
        standing = await _checked(env.client, ref.customer_id, ref.contract_id)
        page = await cc.get_ledger(env.client, ref.customer_id, ref.contract_id)
        await contract.terminate("test done")
    assert [r.incident_id for r in page.rows] == [genuine.incident_id]
    assert [r.counted for r in page.rows] == [False]  # kept, not covered (never validated)
    assert page.rows[0].duplicates == 1 and standing.successful == 0  # the first record stands
    reasons = [r.reason for r in page.rejected]
    assert "sent no outcome" in reasons[0]
    assert "was started for job" in reasons[1]
    assert standing.rejected_claims == 2
