"""ContractWorkflow: one long-lived workflow per customer contract, turning outcomes into the YOCO guarantee.

Id: `torchpass.ids.contract_workflow_id(customer_id, contract_id)`. Opt-ins, validations, expansions and
renewals are updates whose validators answer a bad input with a typed `ApplicationError` (its type is a
`ContractErrorType`) and leave no trace in history; migration outcomes arrive as a fire-and-forget signal
from MigrationWorkflow, decoded here so that a malformed one is counted and dropped, never fatal. A durable
timer wakes the workflow at each renewal date. A credit is delivered to billing by the `deliver_credit`
activity, retried until billing acknowledges it. The rules themselves are pure (`torchpass.contract`);
this module only orders them in time. Continue-as-new carries everything in one `ContractState`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

from temporalio import workflow
from temporalio.common import RawValue, RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from torchpass.contract import ContractBook, day_start
    from torchpass.contract_models import (
        ContractInput,
        ContractRuleError,
        Evaluation,
        ExpandInput,
        JobCoverage,
        LedgerPage,
        LedgerPageInput,
        OptInInput,
        RenewInput,
        Standing,
    )
    from torchpass.credit import CreditDelivery, CreditNotice
    from torchpass.ids import ControlActivity
    from torchpass.models import MigrationOutcome
    from torchpass.validation import ValidationReport

R = TypeVar("R")

# Billing may be down for days; a credit is owed until it says it has it. Each attempt is bounded, the
# attempts are not, and the backoff stops at an hour so that a recovered billing hears from us soon.
DELIVER_CREDIT_TIMEOUT = timedelta(seconds=30)
DELIVER_CREDIT_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(hours=1),
    maximum_attempts=0,
)
# After an activity error that no retry cures (billing said "non-retryable"), try again this much later.
REDELIVER_AFTER = timedelta(hours=6)


def _rejected(e: ContractRuleError) -> ApplicationError:
    return ApplicationError(str(e), type=e.kind.value, non_retryable=True)


@workflow.defn(name="ContractWorkflow")
class ContractWorkflow:
    @workflow.init
    def __init__(self, inp: ContractInput) -> None:
        self._terms = inp.terms
        self._book = ContractBook(inp.terms, inp.state)
        self._handled = 0  # history-growing inputs handled by this run
        self._retry_at = workflow.now()  # when a refused credit is offered to billing again

    # --- inputs --------------------------------------------------------------------------------------

    @workflow.signal
    def record_outcome(self, raw: RawValue) -> None:
        """Fire-and-forget from MigrationWorkflow; a duplicate incident id is counted once."""
        self._handled += 1
        try:
            outcome = workflow.payload_converter().from_payload(raw.payload, MigrationOutcome)
        except Exception as e:
            # The sender cannot hear an error from a signal: count it where an operator looks (standing).
            self._book.rejected_signals += 1
            workflow.logger.warning("malformed record_outcome signal dropped: %s", e)
            return
        entry, duplicate = self._book.record_outcome(outcome)
        if duplicate:
            workflow.logger.info("duplicate outcome %s counted once", entry.incident_id)

    @workflow.update
    def opt_in(self, inp: OptInInput) -> JobCoverage:
        self._handled += 1
        return self._book.opt_in(inp.job_id, workflow.now())

    @opt_in.validator
    def _check_opt_in(self, inp: OptInInput) -> None:
        self._check(lambda: None)

    @workflow.update
    def opt_out(self, inp: OptInInput) -> JobCoverage:
        self._handled += 1
        return self._apply(self._book.opt_out, inp.job_id, workflow.now())

    @opt_out.validator
    def _check_opt_out(self, inp: OptInInput) -> None:
        self._check(self._book.check_opted_in, inp.job_id)

    @workflow.update
    def record_validation(self, report: ValidationReport) -> JobCoverage:
        self._handled += 1
        return self._apply(self._book.record_validation, report)

    @record_validation.validator
    def _check_validation(self, report: ValidationReport) -> None:
        self._check(self._book.check_validation, report)

    @workflow.update
    def expand(self, inp: ExpandInput) -> Evaluation:
        """Evaluate at the expansion (the credit, if any, is delivered by the main loop) and apply its fee."""
        self._handled += 1
        return self._apply(self._book.expand, inp, workflow.now())

    @expand.validator
    def _check_expand(self, inp: ExpandInput) -> None:
        self._check(self._book.check_expand, inp, workflow.now().date())

    @workflow.update
    def renew(self, inp: RenewInput) -> Standing:
        self._handled += 1
        self._apply(self._book.renew, inp)
        return self._book.standing(workflow.now())

    @renew.validator
    def _check_renew(self, inp: RenewInput) -> None:
        self._check(self._book.check_renew, inp)

    def _apply(self, change: Callable[..., R], *args: Any) -> R:
        # The validator already passed; should the rules still refuse (an earlier update in the same
        # activation changed the state), the caller gets the typed error, the workflow task never fails.
        try:
            return change(*args)
        except ContractRuleError as e:
            raise _rejected(e) from e

    def _check(self, check: Callable[..., object], *args: Any) -> None:
        if self._book.lapsed:
            raise ApplicationError("the contract has ended", type="ContractEnded", non_retryable=True)
        try:
            check(*args)
        except ContractRuleError as e:
            raise _rejected(e) from e

    # --- queries -------------------------------------------------------------------------------------

    @workflow.query
    def standing(self) -> Standing:
        return self._book.standing(workflow.now())

    @workflow.query
    def ledger(self, page: LedgerPageInput) -> LedgerPage:
        return self._book.ledger_page(page)

    # --- the main loop -------------------------------------------------------------------------------

    @workflow.run
    async def run(self, inp: ContractInput) -> Standing:
        while not self._book.lapsed:
            await self._wait(lambda: self._delivery_due() or self._should_continue())
            if workflow.now() >= day_start(self._book.renewal_date):
                self._book.close_term(workflow.now())
            if self._delivery_due():
                await self._deliver_pending()
            if self._should_continue() and not self._book.lapsed:
                await self._continue_as_new()
        # Not renewed: the last credit is still owed, then the contract's workflow ends.
        while self._book.pending:
            await self._wait(self._delivery_due)
            await self._deliver_pending()
        await workflow.wait_condition(workflow.all_handlers_finished)
        return self._book.standing(workflow.now())

    async def _wait(self, condition: Callable[[], bool]) -> None:
        """Until `condition` holds, or the next renewal (a durable timer) or credit retry is due."""
        with contextlib.suppress(TimeoutError):
            await workflow.wait_condition(condition, timeout=self._next_wake())

    def _delivery_due(self) -> bool:
        return bool(self._book.pending) and workflow.now() >= self._retry_at

    def _next_wake(self) -> timedelta:
        # A zero timeout would mean "no timeout": when something is due, wake at once instead.
        now = workflow.now()
        wake = day_start(self._book.renewal_date)
        if self._book.pending:
            wake = min(wake, self._retry_at)
        return max(wake - now, timedelta(milliseconds=1))

    def _should_continue(self) -> bool:
        return (
            self._handled >= self._terms.continue_as_new_after
            or workflow.info().is_continue_as_new_suggested()
        )

    async def _deliver_pending(self) -> None:
        for notice in list(self._book.pending):
            delivery = await self._deliver(notice)
            if delivery is None:
                self._retry_at = workflow.now() + REDELIVER_AFTER
                return
            self._book.delivered(delivery)

    async def _deliver(self, notice: CreditNotice) -> CreditDelivery | None:
        try:
            return await workflow.execute_activity(
                ControlActivity.DELIVER_CREDIT,
                notice,
                result_type=CreditDelivery,
                start_to_close_timeout=DELIVER_CREDIT_TIMEOUT,
                retry_policy=DELIVER_CREDIT_RETRY,
            )
        except ActivityError as e:
            workflow.logger.error("credit %s not delivered: %s", notice.idempotency_key, e.cause or e)
            return None

    async def _continue_as_new(self) -> None:
        # Updates still running would be lost with this run: let them finish first.
        await workflow.wait_condition(workflow.all_handlers_finished)
        self._book.prune(workflow.now().date())
        self._book.runs += 1
        workflow.continue_as_new(ContractInput(terms=self._terms, state=self._book.to_state()))


CONTRACT_WORKFLOWS = [ContractWorkflow]
