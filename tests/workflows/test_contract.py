"""ContractWorkflow on the time-skipping server, through the client helpers, with billing mocked.

Two contract years pass in seconds: outcomes are signalled the way MigrationWorkflow sends them,
expansions and renewals are updates, the renewal date is the workflow's own durable timer, and the
credit goes to a fake `deliver_credit` activity registered under the real name (it refuses the first
attempt, so the retry policy is exercised; another is down for hours across a renewal date). With
TORCHPASS_SAVE_HISTORIES=1 every run of each test is saved to
tests/histories/contract_<test>_run<k>.json for the replay test.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Callable
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from temporalio import activity
from temporalio.client import WorkflowExecutionStatus, WorkflowHandle, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from torchpass.contract.credit import CreditDelivery, CreditNotice, Money, credit_idempotency_key
from torchpass.contract.entries import EntryStatus
from torchpass.contract.evaluation import Trigger
from torchpass.contract.rules import add_months, day_start
from torchpass.contract.terms import ContractPurpose, ContractTerms, ExpandInput, RenewInput
from torchpass.contract.verify import OutcomeClaims, ValidationClaim, Verdict, Verdicts
from torchpass.errors import ErrorType
from torchpass.ids import ContractMessage, ControlActivity, contract_workflow_id
from torchpass.incident.outcome import MigrationOutcome
from torchpass.models import Category, Classification, Disposition, FailureKind
from torchpass.validation.checks import build_report
from torchpass.validation.report import CheckResult, CheckStatus, ValidationReport
from workers import contract_client as cc
from workflows.contract import CONTRACT_WORKFLOWS

HISTORIES = Path(__file__).resolve().parents[1] / "histories"
CUSTOMER = "acme-labs"
QUALIFYING = Classification(category=Category.HOST_GPU_FABRIC, qualifying=True, reason="XID 79")


def usd(amount: str) -> Money:
    return Money(amount=Decimal(amount), currency="USD")


class FakeBilling:
    """Billing that refuses each notice once, then acknowledges it."""

    def __init__(self) -> None:
        self.attempts: dict[str, int] = {}
        self.accepted: list[CreditNotice] = []

    @activity.defn(name=ControlActivity.DELIVER_CREDIT)
    async def deliver(self, notice: CreditNotice) -> CreditDelivery:
        n = self.attempts[notice.idempotency_key] = self.attempts.get(notice.idempotency_key, 0) + 1
        if n == 1:
            raise RuntimeError("billing webhook answered 503")
        self.accepted.append(notice)
        return CreditDelivery(
            idempotency_key=notice.idempotency_key,
            webhook_status=202,
            delivered_at=datetime.now(UTC),
        )


class BillingOutage:
    """Billing that is unreachable until `up` is set: every attempt fails with a retryable error."""

    def __init__(self) -> None:
        self.up = False
        self.attempts = 0
        self.accepted: list[CreditNotice] = []

    @activity.defn(name=ControlActivity.DELIVER_CREDIT)
    async def deliver(self, notice: CreditNotice) -> CreditDelivery:
        self.attempts += 1
        if not self.up:
            raise RuntimeError("billing webhook unreachable: connection refused")
        self.accepted.append(notice)
        return CreditDelivery(
            idempotency_key=notice.idempotency_key,
            webhook_status=202,
            delivered_at=datetime.now(UTC),
        )


@activity.defn(name=ControlActivity.VERIFY_OUTCOMES)
async def trust_outcomes(inp: OutcomeClaims) -> Verdicts:
    """Stands in for the ledger's checks, which test_ledger_checks.py runs for real: these tests are
    about the contract's rules, and their outcomes come from no incident workflow."""
    return Verdicts(
        verdicts=tuple(Verdict(claim=o.incident_id, accepted=True) for o in inp.outcomes)
    )


@activity.defn(name=ControlActivity.VERIFY_VALIDATION)
async def trust_validation(inp: ValidationClaim) -> Verdict:
    """As trust_outcomes, for the reports these tests make up."""
    return Verdict(claim=inp.report.source or "test", accepted=True)


TRUSTING: list[Callable[..., Any]] = [trust_outcomes, trust_validation]


class Contract:
    """One contract under test: its queue, its ids, helpers that speak through contract_client."""

    def __init__(
        self,
        env: WorkflowEnvironment,
        start: date,
        cas_after: int = 2000,
        purpose: ContractPurpose = ContractPurpose.CUSTOMER,
    ) -> None:
        self.env, self.client = env, env.client
        self.queue = f"contract-{uuid.uuid4().hex[:8]}"
        self.id = f"c-{uuid.uuid4().hex[:8]}"
        self.terms = ContractTerms(
            customer_id=CUSTOMER,
            contract_id=self.id,
            start=start,
            renewal_date=add_months(start, 12),
            annual_fee=usd("120000.00"),
            continue_as_new_after=cas_after,
            purpose=purpose,
        )
        self.n = 0

    async def create(self) -> WorkflowHandle[Any, Any]:
        return await cc.create_contract(self.client, self.terms, task_queue=self.queue)

    async def cover(self, job: str, passed: bool = True, waived: bool = False) -> None:
        await cc.opt_in(self.client, CUSTOMER, self.id, job)
        now = await self.env.get_current_time()
        check = CheckResult(name="torch_backend", passed=passed)
        if waived:  # the scheduler check waived by the local-development override
            scheduler = CheckResult(
                name="scheduler", status=CheckStatus.WAIVED, detail="allow_local"
            )
            report = build_report(self.id, job, [check, scheduler], now)
        else:
            report = ValidationReport(
                contract_id=self.id, job_id=job, passed=passed, checks=(check,), validated_at=now
            )
        await cc.record_validation(self.client, CUSTOMER, report)

    def outcome(self, at: datetime, success: bool = True, job: str = "job-a") -> MigrationOutcome:
        self.n += 1
        return MigrationOutcome(
            incident_id=f"torchpass-incident-{job}-node-{self.n % 16}-g{self.n}/{uuid.uuid4()}",
            job_id=job,
            failure_domain=f"node-{self.n % 16}",
            kind=FailureKind.GPU_FELL_OFF_BUS,
            evidence_count=2,
            classification=QUALIFYING,
            covered=True,
            disposition=Disposition.MIGRATED if success else Disposition.FALLBACK_RESTART,
            success=success,
            detected_at=at,
        )

    async def send(
        self, since: datetime, count: int, failures: int, job: str = "job-a"
    ) -> list[MigrationOutcome]:
        """`count` outcomes spread over the time from `since` to now, the first `failures`
        failed."""
        now = await self.env.get_current_time()
        step = (now - since) / (count + 1)
        sent = [
            self.outcome(since + step * (i + 1), success=i >= failures, job=job)
            for i in range(count)
        ]
        for o in sent:
            await cc.record_outcome(self.client, CUSTOMER, self.id, o)
        # A burst of signals racing a continue-as-new can leave the time-skipping server holding a
        # refused workflow task (sdk-java#3088); letting server time pass times it out, and the
        # retried task runs.
        await self.env.sleep(timedelta(seconds=15))
        return sent

    async def standing(self) -> cc.Standing:
        """The standing once every outcome sent has been checked (outcomes count only then)."""
        for _ in range(400):
            s = await cc.get_standing(self.client, CUSTOMER, self.id)
            if s.unverified == 0:
                return s
            await asyncio.sleep(0.05)
        raise AssertionError(f"{s.unverified} outcomes never checked")

    async def advance_to(self, d: date, hours: int = 1) -> datetime:
        target = day_start(d) + timedelta(hours=hours)
        await self.env.sleep(target - await self.env.get_current_time())
        return await self.env.get_current_time()

    async def save(self, name: str, first_run: str) -> None:
        """Every run of the contract, following continue-as-new from the first."""
        if os.environ.get("TORCHPASS_SAVE_HISTORIES") != "1":
            return
        HISTORIES.mkdir(exist_ok=True)
        run: str | None = first_run
        k = 0
        while run:
            history = await self.client.get_workflow_handle(
                contract_workflow_id(CUSTOMER, self.id), run_id=run
            ).fetch_history()
            (HISTORIES / f"contract_{name}_run{k}.json").write_text(history.to_json())
            last = history.events[-1]
            cont = last.workflow_execution_continued_as_new_event_attributes
            run = (
                cont.new_execution_run_id
                if last.HasField("workflow_execution_continued_as_new_event_attributes")
                else None
            )
            k += 1


@pytest.fixture
def name(request: pytest.FixtureRequest) -> str:
    return str(request.node.name)


async def _start_day(env: WorkflowEnvironment) -> date:
    return (await env.get_current_time()).date()


async def _wait_delivered(c: Contract, keys: int) -> cc.Standing:
    for _ in range(60):
        s = await c.standing()
        if len(s.delivered_credits) >= keys:
            return s
        await c.env.sleep(timedelta(seconds=30))
    raise AssertionError("credit never delivered")


async def test_two_contract_years_expansions_renewals_and_exactly_one_credit(
    env: WorkflowEnvironment, name: str
) -> None:
    start = await _start_day(env)
    c = Contract(env, start, cas_after=60)
    billing = FakeBilling()
    async with Worker(
        env.client,
        task_queue=c.queue,
        workflows=CONTRACT_WORKFLOWS,
        activities=[billing.deliver, *TRUSTING],
    ):
        handle = await c.create()
        await c.cover("job-a")
        t = await env.get_current_time()

        # Month 2: an expansion measured over under 3 months is recorded, not evaluated.
        t2 = await c.advance_to(add_months(start, 2))
        first = await c.send(t, 30, failures=0)
        exp2 = await cc.expand(
            c.client, CUSTOMER, c.id, ExpandInput(on=t2.date(), annual_fee=usd("130000"))
        )
        assert not exp2.evaluated and exp2.credit is None

        # Month 5: evaluated, 68/70 = 97%, no credit. The fee in force then (130k) was the one
        # measured.
        t5 = await c.advance_to(add_months(start, 5))
        await c.send(t2, 40, failures=2)
        # a duplicate, after a continue-as-new
        await cc.record_outcome(c.client, CUSTOMER, c.id, first[0])
        exp5 = await cc.expand(
            c.client, CUSTOMER, c.id, ExpandInput(on=t5.date(), annual_fee=usd("150000"))
        )
        assert (
            exp5.evaluated
            and (exp5.qualifying, exp5.successful) == (70, 68)
            and exp5.credit is None
        )
        assert exp5.fee == usd("130000")

        # Months 5-11: 130 more, 20 failed: the year ends at 178/200 = 89% -> one credit at renewal.
        await c.advance_to(add_months(start, 11))
        await c.send(t5, 130, failures=20)
        await c.send(t5, 5, failures=5, job="job-uncovered")
        standing = await c.standing()
        assert (standing.qualifying, standing.successful) == (200, 178)
        assert standing.projected_credit == usd("37500.00") and standing.duplicates == 1
        assert standing.excluded == {EntryStatus.NOT_OPTED_IN: 5}
        ledger = await cc.get_ledger(c.client, CUSTOMER, c.id, offset=200, limit=100)
        await cc.renew(c.client, CUSTOMER, c.id, RenewInput())
        renewal1 = c.terms.renewal_date
        await c.advance_to(renewal1, hours=2)
        await _wait_delivered(c, 1)

        # Year 2: 95 of 100 live-migrated; not renewed, so the contract is evaluated, awaits a late
        # renewal for the 60 days of grace, and ends when they pass without one.
        y2 = await env.get_current_time()
        await c.advance_to(add_months(start, 23))
        await c.send(y2, 100, failures=5)
        renewal2 = add_months(renewal1, 12)
        await c.advance_to(renewal2, hours=3)
        awaiting = await c.standing()
        grace_ends = renewal2 + timedelta(days=60)
        assert awaiting.awaiting_renewal and awaiting.renewal_grace_ends == grace_ends
        assert awaiting.term == 1 and awaiting.next_evaluation is None and not awaiting.lapsed
        await c.advance_to(grace_ends - timedelta(days=1))
        wf = c.client.get_workflow_handle(contract_workflow_id(CUSTOMER, c.id))
        assert (await wf.describe()).status == WorkflowExecutionStatus.RUNNING
        await c.advance_to(grace_ends, hours=1)
        final: cc.Standing = await handle.result()
        last = await cc.get_ledger(c.client, CUSTOMER, c.id, offset=0, limit=1000)
    await c.save(name, handle.result_run_id or "")

    assert len(billing.accepted) == 1 and billing.attempts == {
        billing.accepted[0].idempotency_key: 2
    }
    notice = billing.accepted[0]
    assert notice.idempotency_key == credit_idempotency_key(c.id, renewal1)
    assert (notice.contract_id, notice.customer_id, notice.trigger) == (c.id, CUSTOMER, "renewal")
    assert (notice.period_start, notice.period_end) == (start, renewal1)
    assert (notice.qualifying, notice.successful, notice.success_rate) == (
        200,
        178,
        Decimal("0.89"),
    )
    assert notice.amount == usd("37500.00") and notice.apply_to == f"renewal on {renewal1}"
    triggers = [(e.trigger.value, e.evaluated, e.credit is not None) for e in final.evaluations]
    assert triggers == [
        ("expansion", False, False),
        ("expansion", True, False),
        ("renewal", True, True),
        ("renewal", True, False),
    ]
    y2_eval = final.evaluations[-1]
    assert (y2_eval.qualifying, y2_eval.successful, y2_eval.term) == (100, 95, 1)
    assert final.delivered_credits == (notice.idempotency_key,) and final.pending_credits == 0
    # What no future window could count was dropped from the carried state; year 2 is all there.
    assert last.pruned > 0 and last.total + last.pruned == 305
    assert final.runs >= 3 and final.duplicates == 1 and final.next_evaluation is None
    assert final.lapsed and not final.awaiting_renewal and final.term == 1
    # Pages of the ledger; the 5 outcomes of an uncovered job are kept, with their reason, not
    # counted.
    assert ledger.total == 205 and len(ledger.rows) == 5 and ledger.next_offset is None
    uncovered = [r for r in ledger.rows if r.job_id == "job-uncovered"]
    assert len(uncovered) == 5 and all(
        not r.counted and r.reason and "not opted in" in r.reason for r in uncovered
    )


async def _run_id(c: Contract) -> str:
    # describe, not a query: a query that meets a run as it continues-as-new can go unanswered on
    # the time-skipping server.
    desc = await c.client.get_workflow_handle(contract_workflow_id(CUSTOMER, c.id)).describe()
    return desc.run_id


async def _wait_new_run(c: Contract, old: str) -> cc.Standing:
    for _ in range(60):
        if await _run_id(c) != old:
            return await c.standing()
        await c.env.sleep(timedelta(seconds=1))
    raise AssertionError("the contract never continued-as-new")


async def test_a_billing_outage_across_a_renewal_never_stalls_the_contract(
    env: WorkflowEnvironment, name: str
) -> None:
    start = await _start_day(env)
    c = Contract(env, start, cas_after=5)
    billing = BillingOutage()
    renewal = c.terms.renewal_date
    async with Worker(
        env.client,
        task_queue=c.queue,
        workflows=CONTRACT_WORKFLOWS,
        activities=[billing.deliver, *TRUSTING],
    ):
        handle = await c.create()
        await c.cover("job-a")
        t = await env.get_current_time()

        # 23:30 the day before the renewal: an expansion at 6/10 earns a credit, and billing is
        # down.
        await env.sleep(day_start(renewal) - timedelta(minutes=30) - t)
        await c.send(t, 10, failures=4)
        await cc.renew(c.client, CUSTOMER, c.id, RenewInput())
        on = renewal - timedelta(days=1)
        exp = await cc.expand(
            c.client, CUSTOMER, c.id, ExpandInput(on=on, annual_fee=usd("120000.00"))
        )
        assert exp.credit is not None

        # 01:00: the delivery, still retried as the renewal date came, gave up within its hour
        # (00:30); the renewal was evaluated then, not held up by billing, and the credit waits for
        # its next offer.
        await env.sleep(day_start(renewal) + timedelta(hours=1) - await env.get_current_time())
        s1 = await c.standing()
        assert s1.term == 1 and s1.renewal_date == add_months(renewal, 12)
        closing = s1.evaluations[-1]
        assert (closing.trigger, closing.period_end, closing.term) == (Trigger.RENEWAL, renewal, 0)
        assert closing.credit is None  # the year's one credit is the expansion's
        assert closing.credit_period_start == on  # and nothing since it was measured twice
        assert s1.pending_credits == 1 and s1.delivered_credits == () and billing.attempts > 1
        retry = s1.next_credit_retry
        assert retry is not None
        assert (
            day_start(renewal) + timedelta(hours=6)
            < retry
            < day_start(renewal) + timedelta(hours=7)
        )
        # Continue-as-new keeps the pending credit and its retry time: no redelivery at once.
        attempts, run = billing.attempts, await _run_id(c)
        await c.send(await env.get_current_time(), c.terms.continue_as_new_after, failures=0)
        s2 = await _wait_new_run(c, run)
        assert s2.runs == s1.runs + 1
        assert (
            s2.next_credit_retry == retry
            and s2.pending_credits == 1
            and billing.attempts == attempts
        )

        # Billing is back: the next offer delivers the credit, once.
        billing.up = True
        await env.sleep(retry + timedelta(minutes=1) - await env.get_current_time())
        delivered = await _wait_delivered(c, 1)
        attempts = billing.attempts
        await env.sleep(timedelta(days=2))
        final = await c.standing()
        await handle.terminate("test done")
    await c.save(name, handle.result_run_id or "")

    key = credit_idempotency_key(c.id, on)
    assert [n.idempotency_key for n in billing.accepted] == [key]
    assert delivered.delivered_credits == (key,) and delivered.pending_credits == 0
    assert final.delivered_credits == (key,) and final.next_credit_retry is None
    assert billing.attempts == attempts  # nothing offered after billing took it
    assert final.runs > s1.runs and final.term == 1


async def test_bad_input_gets_a_typed_error_and_the_contract_keeps_running(
    env: WorkflowEnvironment, name: str
) -> None:
    start = await _start_day(env)
    c = Contract(env, start)
    billing = FakeBilling()
    async with Worker(
        env.client,
        task_queue=c.queue,
        workflows=CONTRACT_WORKFLOWS,
        activities=[billing.deliver, *TRUSTING],
    ):
        handle = await c.create()
        with pytest.raises(cc.ContractExists):
            await c.create()
        today = (await env.get_current_time()).date()

        async def rejected(inp: ExpandInput) -> str:
            with pytest.raises(cc.ContractRejected) as e:
                await cc.expand(c.client, CUSTOMER, c.id, inp)
            return e.value.error_type

        assert (
            await rejected(ExpandInput(on=today, annual_fee=usd("-10")))
            == ErrorType.CONTRACT_INVALID_FEE
        )
        later = today + timedelta(days=3)
        assert (
            await rejected(ExpandInput(on=later, annual_fee=usd("10")))
            == ErrorType.CONTRACT_DATES_OUT_OF_ORDER
        )
        eur = Money(amount=Decimal("10"), currency="EUR")
        assert (
            await rejected(ExpandInput(on=today, annual_fee=eur))
            == ErrorType.CONTRACT_CURRENCY_MISMATCH
        )
        await c.cover("job-a")
        with pytest.raises(cc.ContractRejected) as e:
            await cc.opt_out(c.client, CUSTOMER, c.id, "job-unknown")
        assert e.value.error_type == ErrorType.CONTRACT_UNKNOWN_JOB
        report = ValidationReport(
            contract_id=c.id,
            job_id="job-unknown",
            passed=True,
            checks=(CheckResult(name="agent_present", passed=True),),
            validated_at=await env.get_current_time(),
        )
        with pytest.raises(cc.ContractRejected) as e:
            await cc.record_validation(c.client, CUSTOMER, report)
        assert e.value.error_type == ErrorType.CONTRACT_UNKNOWN_JOB
        with pytest.raises(cc.ContractRejected) as e:
            await cc.renew(c.client, CUSTOMER, c.id, RenewInput(next_renewal=start))
        assert e.value.error_type == ErrorType.CONTRACT_DATES_OUT_OF_ORDER
        for update, arg, field in (  # not even a model: refused by the validator, naming the field
            ("expand", {"on": "yesterday", "annual_fee": 5}, "on"),
            ("opt_in", {"job": "job-a"}, "job_id"),
            ("renew", None, "got NoneType"),
            ("record_validation", {"contract_id": 7}, "status"),
        ):
            with pytest.raises(WorkflowUpdateFailedError) as failed:
                await handle.execute_update(update, arg)
            cause = failed.value.cause
            assert isinstance(cause, ApplicationError) and cause.type == ErrorType.INVALID_INPUT
            assert f"malformed {update} input" in cause.message and field in cause.message, (
                cause.message
            )
        for client_call in (
            cc.get_standing(c.client, CUSTOMER, "no-such-contract"),
            cc.opt_in(c.client, CUSTOMER, "no-such-contract", "job-a"),
        ):
            with pytest.raises(cc.UnknownContract):
                await client_call

        now = await env.get_current_time()
        await handle.signal(
            ContractMessage.RECORD_OUTCOME, {"incident_id": 7, "detected_at": "soon"}
        )
        o = c.outcome(now, success=False, job="job-a")
        await cc.record_outcome(c.client, CUSTOMER, c.id, o)
        await cc.record_outcome(c.client, CUSTOMER, c.id, o)
        await cc.record_outcome(c.client, CUSTOMER, c.id, c.outcome(now, job="job-nobody-knows"))
        standing = await c.standing()
        ledger = await cc.get_ledger(c.client, CUSTOMER, c.id)
        await handle.terminate("test done")
    await c.save(name, handle.result_run_id or "")

    assert standing.rejected_signals == 1 and standing.duplicates == 1
    assert (standing.qualifying, standing.successful) == (1, 0)  # the duplicate counted once
    assert standing.covered_jobs == ("job-a",)
    assert standing.evaluations == () and standing.annual_fee == usd("120000.00")
    rows = {r.job_id: r for r in ledger.rows}
    assert ledger.total == 2 and rows["job-a"].duplicates == 1
    assert (
        rows["job-nobody-knows"].status is EntryStatus.NOT_OPTED_IN
        and not rows["job-nobody-knows"].counted
    )
    assert billing.accepted == []


async def test_a_failed_validation_leaves_outcomes_uncovered(
    env: WorkflowEnvironment, name: str
) -> None:
    c = Contract(env, await _start_day(env))
    async with Worker(
        env.client, task_queue=c.queue, workflows=CONTRACT_WORKFLOWS, activities=TRUSTING
    ):
        handle = await c.create()
        await c.cover("job-b", passed=False)
        now = await env.get_current_time()
        await cc.record_outcome(
            c.client, CUSTOMER, c.id, c.outcome(now, success=False, job="job-b")
        )
        standing = await c.standing()
        await handle.terminate("test done")
    await c.save(name, handle.result_run_id or "")
    assert standing.qualifying == 0 and standing.excluded == {EntryStatus.VALIDATION_FAILED: 1}
    assert "no qualifying failures" in standing.summary and standing.projected_credit is None


async def test_an_outcome_arriving_just_after_the_renewal_counts_in_its_own_term(
    env: WorkflowEnvironment, name: str
) -> None:
    """An incident detected a minute before midnight on the renewal date, recorded five minutes
    after: the term closes after a settling time, so the outcome is in the renewal's evaluation, not
    lost between two windows."""
    start = await _start_day(env)
    c = Contract(env, start)
    async with Worker(
        env.client,
        task_queue=c.queue,
        workflows=CONTRACT_WORKFLOWS,
        activities=[FakeBilling().deliver, *TRUSTING],
    ):
        handle = await c.create()
        await c.cover("job-a")
        await cc.renew(c.client, CUSTOMER, c.id, RenewInput())
        renewal = day_start(c.terms.renewal_date)
        await env.sleep(renewal + timedelta(minutes=5) - await env.get_current_time())
        await cc.record_outcome(
            c.client, CUSTOMER, c.id, c.outcome(renewal - timedelta(minutes=1), False)
        )
        await env.sleep(timedelta(hours=1))
        standing = await c.standing()
        # Left running, its timer would come due (with no worker) when a later test skips time.
        await handle.terminate("test done")
    await c.save(name, handle.result_run_id or "")
    (ev,) = [e for e in standing.evaluations if e.trigger is Trigger.RENEWAL]
    assert (ev.qualifying, ev.successful) == (1, 0) and ev.credit is not None


async def test_a_renewal_ten_days_late_starts_the_next_term_from_the_renewal_date(
    env: WorkflowEnvironment, name: str
) -> None:
    """Billing recorded the renewal 10 days late: the term was evaluated at its date, the contract
    kept recording meanwhile, and the late `renew` starts the next term from the renewal date, so
    that the outcomes of those 10 days count in it."""
    start = await _start_day(env)
    c = Contract(env, start)
    async with Worker(
        env.client,
        task_queue=c.queue,
        workflows=CONTRACT_WORKFLOWS,
        activities=[FakeBilling().deliver, *TRUSTING],
    ):
        handle = await c.create()
        await c.cover("job-a")
        t = await env.get_current_time()
        await c.advance_to(add_months(start, 6))
        await c.send(t, 10, failures=0)
        renewal = c.terms.renewal_date
        t1 = await c.advance_to(renewal, hours=2)
        s0 = await c.standing()
        closing = s0.evaluations[-1]
        assert (closing.trigger, closing.period_end, closing.term) == (Trigger.RENEWAL, renewal, 0)
        assert (closing.qualifying, closing.successful) == (10, 10)
        assert s0.awaiting_renewal and s0.renewal_grace_ends == renewal + timedelta(days=60)
        assert s0.term == 0 and s0.next_evaluation is None

        # 10 days late: outcomes and opt-ins are still recorded, expansions wait for the renewal.
        await c.advance_to(renewal + timedelta(days=10))
        late = await c.send(t1, 4, failures=1)
        await cc.opt_in(c.client, CUSTOMER, c.id, "job-b")
        with pytest.raises(cc.ContractRejected) as e:
            today = (await env.get_current_time()).date()
            await cc.expand(
                c.client, CUSTOMER, c.id, ExpandInput(on=today, annual_fee=usd("150000"))
            )
        assert e.value.error_type == ErrorType.CONTRACT_AWAITING_RENEWAL
        renewed = await cc.renew(c.client, CUSTOMER, c.id, RenewInput(annual_fee=usd("130000")))
        renewal2 = add_months(renewal, 12)
        assert (renewed.term, renewed.term_start, renewed.renewal_date) == (1, renewal, renewal2)
        assert not renewed.awaiting_renewal and renewed.next_evaluation == renewal2
        assert renewed.annual_fee == usd("130000")

        # The next renewal measures the new term from the old renewal date, the 10 days included.
        await c.advance_to(renewal2, hours=2)
        s2 = await c.standing()
        ledger = await cc.get_ledger(c.client, CUSTOMER, c.id)
        await handle.terminate("test done")
    await c.save(name, handle.result_run_id or "")
    ev = s2.evaluations[-1]
    assert (ev.trigger, ev.term, ev.period_start, ev.period_end) == (
        Trigger.RENEWAL,
        1,
        renewal,
        renewal2,
    )
    assert (ev.qualifying, ev.successful) == (4, 3) and ev.fee == usd("130000")
    assert s2.awaiting_renewal and s2.term == 1  # not renewed again: in its own grace now
    late_ids = {o.incident_id for o in late}
    assert all(not r.late for r in ledger.rows if r.incident_id in late_ids)


async def test_a_development_contract_counts_waived_jobs_and_never_credits_billing(
    env: WorkflowEnvironment, name: str
) -> None:
    """A job validated with a waived check covers on a development contract, its outcomes count, and
    a year at 60% is evaluated as any other but issues no credit: billing never hears from it."""
    start = await _start_day(env)
    c = Contract(env, start, purpose=ContractPurpose.DEVELOPMENT)
    billing = FakeBilling()
    async with Worker(
        env.client,
        task_queue=c.queue,
        workflows=CONTRACT_WORKFLOWS,
        activities=[billing.deliver, *TRUSTING],
    ):
        handle = await c.create()
        await c.cover("job-a", waived=True)
        t = await env.get_current_time()
        await c.advance_to(add_months(start, 6))
        await c.send(t, 10, failures=4)
        mid = await c.standing()
        await cc.renew(c.client, CUSTOMER, c.id, RenewInput())
        await c.advance_to(c.terms.renewal_date, hours=2)
        standing = await c.standing()
        await handle.terminate("test done")
    await c.save(name, handle.result_run_id or "")
    assert mid.purpose is ContractPurpose.DEVELOPMENT and mid.covered_jobs == ("job-a",)
    assert (mid.qualifying, mid.successful) == (10, 6) and mid.projected_credit is None
    ev = standing.evaluations[-1]
    assert (ev.trigger, ev.qualifying, ev.successful, ev.credit) == (Trigger.RENEWAL, 10, 6, None)
    assert "development contract never issues a credit notice to billing" in ev.note
    assert standing.pending_credits == 0 and standing.delivered_credits == () and standing.term == 1
    assert billing.attempts == {} and billing.accepted == []
