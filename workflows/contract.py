"""ContractWorkflow: one long-lived workflow per customer contract, turning outcomes into the YOCO
guarantee.

Id: `torchpass.ids.contract_workflow_id(customer_id, contract_id)`. Opt-ins, validations, expansions
and renewals are updates whose validators answer a bad input with a typed `ApplicationError` (its
type is a `Contract*` `ErrorType`) and leave no trace in history; migration outcomes arrive as a
fire-and-forget signal from MigrationWorkflow, decoded here so that a malformed one is counted and
dropped, never fatal. A durable timer wakes the workflow at each renewal date. A term that ends
unrenewed is evaluated all the same and the contract then awaits a late `renew` for
`terms.renewal_grace_days` (still recording outcomes and opt-ins); only when that grace passes does
it lapse and the workflow end. A credit is delivered to billing by the `deliver_credit` activity
(`workflows.credit_delivery`). A billing outage holds up the renewal timer, the evaluations and
continue-as-new for at most `DELIVER_CREDIT_SCHEDULE_TO_CLOSE`: then the delivery gives up, the
credit stays pending, and it is offered again `REDELIVER_AFTER` later (that time travels in the
state, across continue-as-new).

This module holds the workflow's handlers and its main loop. The rules themselves are pure
(`ContractBook`, `torchpass.contract.rules`); when the loop wakes is `workflows.contract_wakeups`;
the activities it calls are steps in `workflows.checks` and `workflows.credit_delivery`.
Continue-as-new carries everything in one `ContractState`.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import date
from decimal import Decimal
from typing import Any, TypeVar

from temporalio import workflow
from temporalio.common import RawValue
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from torchpass.contract.book import ContractBook
    from torchpass.contract.coverage import JobCoverage
    from torchpass.contract.credit import Money
    from torchpass.contract.evaluation import Evaluation
    from torchpass.contract.queries import LedgerPage, LedgerPageInput, Standing
    from torchpass.contract.state import ContractInput
    from torchpass.contract.terms import (
        ContractRuleError,
        ContractTerms,
        ExpandInput,
        OptInInput,
        RenewInput,
    )
    from torchpass.errors import ErrorType
    from torchpass.ids import ContractMessage, WorkflowName
    from torchpass.incident.outcome import MigrationOutcome
    from torchpass.policies import VERIFY_AGAIN_AFTER
    from torchpass.validation.report import ValidationReport
    from workflows.checks import check_outcomes, check_validation
    from workflows.contract_wakeups import Wakeups
    from workflows.credit_delivery import deliver_credits
    from workflows.inputs import decode, decode_start
    from workflows.logs import logger

R = TypeVar("R")

# Runs from before the ledger checked its claims took outcomes and validations on their word.
VERIFIED_LEDGER = "verified-ledger"


# Stands in for the terms of a contract started with a malformed input, which fails at once: never
# shown.
_PLACEHOLDER = ContractInput(
    terms=ContractTerms(
        customer_id="malformed-start",
        contract_id="malformed-start",
        start=date(2000, 1, 1),
        renewal_date=date(2001, 1, 1),
        annual_fee=Money(amount=Decimal(1), currency="USD"),
    )
)


def _rejected(e: ContractRuleError) -> ApplicationError:
    return ApplicationError(str(e), type=e.error_type.value, non_retryable=True)


@workflow.defn(name=WorkflowName.CONTRACT)
class ContractWorkflow:
    @workflow.init
    def __init__(self, start: RawValue) -> None:
        self._bad: ApplicationError | None = None
        try:
            inp = decode_start(start, ContractInput)
        # `run` fails the workflow with it; every input is refused meanwhile
        except ApplicationError as e:
            self._bad, inp = e, _PLACEHOLDER
        self._terms = inp.terms
        self._book = ContractBook(inp.terms, inp.state)
        self._handled = 0  # history-growing inputs handled by this run
        self._wakeups = Wakeups(self._book)

    # --- inputs
    # --------------------------------------------------------------------------------------

    @workflow.signal(name=ContractMessage.RECORD_OUTCOME)
    def record_outcome(self, raw: RawValue) -> None:
        """Fire-and-forget from MigrationWorkflow; a duplicate incident id is counted once. Held
        until checked against the incident's own workflow (`_verify_pending`): only then is it
        counted."""
        if self._bad is not None:
            return
        self._handled += 1
        try:
            outcome = workflow.payload_converter().from_payload(raw.payload, MigrationOutcome)
            if not isinstance(outcome, MigrationOutcome):  # a null payload decodes to None
                raise TypeError(f"got {type(outcome).__name__}")
        except Exception as e:
            # The sender cannot hear an error from a signal: count it where an operator looks
            # (standing).
            self._book.rejected_signals += 1
            logger.warning("malformed record_outcome signal dropped: %s", e)
            return
        if workflow.patched(VERIFIED_LEDGER):
            if not self._book.receive(outcome):
                self._book.rejected_signals += 1
                logger.warning("outcome %s refused: too many await a check", outcome.incident_id)
            return
        entry, duplicate = self._book.record_outcome(outcome)
        if duplicate:
            logger.info("duplicate outcome %s counted once", entry.incident_id)

    @workflow.update(name=ContractMessage.OPT_IN)
    def opt_in(self, raw: RawValue) -> JobCoverage:
        inp = decode(raw, OptInInput, "opt_in input")
        self._handled += 1
        return self._book.jobs.opt_in(inp.job_id, workflow.now())

    @opt_in.validator
    def _check_opt_in(self, raw: RawValue) -> None:
        decode(raw, OptInInput, "opt_in input")
        self._check(lambda: None)

    @workflow.update(name=ContractMessage.OPT_OUT)
    def opt_out(self, raw: RawValue) -> JobCoverage:
        inp = decode(raw, OptInInput, "opt_out input")
        self._handled += 1
        return self._apply(self._book.jobs.opt_out, inp.job_id, workflow.now())

    @opt_out.validator
    def _check_opt_out(self, raw: RawValue) -> None:
        inp = decode(raw, OptInInput, "opt_out input")
        self._check(self._book.jobs.check_opted_in, inp.job_id)

    @workflow.update(name=ContractMessage.RECORD_VALIDATION)
    async def record_validation(self, raw: RawValue) -> JobCoverage:
        """Recorded once the report's own validation workflow shows it made it
        (`contract/verify.py`)."""
        report = decode(raw, ValidationReport, "record_validation input")
        self._handled += 1
        if workflow.patched(VERIFIED_LEDGER):
            enrolment = self._terms.enrolment_key
            verdict = await check_validation(report, workflow.info().workflow_id, enrolment)
            if not verdict.accepted:
                now = workflow.now()
                self._book.checks.reject(
                    verdict.claim, report.job_id, now, f"validation: {verdict.reason}"
                )
                raise ApplicationError(
                    f"validation not recorded: {verdict.reason}",
                    type=ErrorType.CONTRACT_UNVERIFIED.value,
                    non_retryable=True,
                )
        return self._apply(self._book.jobs.record_validation, report)

    @record_validation.validator
    def _check_validation(self, raw: RawValue) -> None:
        report = decode(raw, ValidationReport, "record_validation input")
        self._check(self._book.jobs.check_validation, report)

    @workflow.update(name=ContractMessage.EXPAND)
    def expand(self, raw: RawValue) -> Evaluation:
        """Evaluate at the expansion (the credit, if any, is delivered by the main loop) and apply
        its fee."""
        inp = decode(raw, ExpandInput, "expand input")
        self._handled += 1
        return self._apply(self._book.expand, inp, workflow.now())

    @expand.validator
    def _check_expand(self, raw: RawValue) -> None:
        inp = decode(raw, ExpandInput, "expand input")
        self._check(self._book.check_expand, inp, workflow.now().date())

    @workflow.update(name=ContractMessage.RENEW)
    def renew(self, raw: RawValue) -> Standing:
        inp = decode(raw, RenewInput, "renew input")
        self._handled += 1
        self._apply(self._book.term.renew, inp, workflow.now().date())
        return self._book.standing(workflow.now())

    @renew.validator
    def _check_renew(self, raw: RawValue) -> None:
        inp = decode(raw, RenewInput, "renew input")
        self._check(self._book.term.check_renew, inp, workflow.now().date())

    def _apply(self, change: Callable[..., R], *args: Any) -> R:
        # The validator already passed; should the rules still refuse (an earlier update in the same
        # activation changed the state), the caller gets the typed error, the workflow task never
        # fails.
        try:
            return change(*args)
        except ContractRuleError as e:
            raise _rejected(e) from e

    def _check(self, check: Callable[..., object], *args: Any) -> None:
        if self._bad is not None:
            raise self._bad
        if self._book.term.lapsed:
            raise ApplicationError(
                "the contract has ended", type=ErrorType.CONTRACT_ENDED.value, non_retryable=True
            )
        try:
            check(*args)
        except ContractRuleError as e:
            raise _rejected(e) from e

    # --- queries
    # -------------------------------------------------------------------------------------

    @workflow.query(name=ContractMessage.STANDING)
    def standing(self) -> Standing:
        if self._bad is not None:
            raise self._bad
        return self._book.standing(workflow.now())

    @workflow.query(name=ContractMessage.LEDGER)
    def ledger(self, raw: RawValue) -> LedgerPage:
        page = decode(raw, LedgerPageInput, "ledger query")
        if self._bad is not None:
            raise self._bad
        return self._book.ledger_page(page)

    # --- the main loop
    # -------------------------------------------------------------------------------

    @workflow.run
    async def run(self, start: RawValue) -> Standing:
        if self._bad is not None:
            raise self._bad
        due, credits = self._wakeups, self._book.evaluations
        while not self._book.term.lapsed:
            await due.wait(
                lambda: due.delivery_due() or self._should_continue() or due.verify_due()
            )
            while due.verify_due():  # before a term closes: what arrived in time counts in it
                await self._verify_pending()
            if due.renewal_due():
                self._book.close_term(workflow.now())
            # Unrenewed past the grace (at once when there is none): the contract lapses.
            self._book.term.lapse_if_unrenewed(workflow.now())
            if due.delivery_due():
                # Bounded: gives up within DELIVER_CREDIT_SCHEDULE_TO_CLOSE, the credit staying
                # pending.
                await deliver_credits(credits)
            if self._should_continue() and not self._book.term.lapsed:
                await self._continue_as_new()
        # Not renewed within the grace: the last credit is still owed, then the contract's workflow
        # ends.
        while credits.pending_credits:
            await due.wait(due.delivery_due)
            if due.delivery_due():
                await deliver_credits(credits)
        await workflow.wait_condition(workflow.all_handlers_finished)
        return self._book.standing(workflow.now())

    def _should_continue(self) -> bool:
        return (
            self._handled >= self._terms.continue_as_new_after
            or workflow.info().is_continue_as_new_suggested()
        )

    async def _verify_pending(self) -> None:
        """Check the queued outcomes (`workflows.checks`); a check that could not run is tried again
        `VERIFY_AGAIN_AFTER` later."""
        if await check_outcomes(self._book, workflow.info().workflow_id):
            self._wakeups.verify_at = None
        else:  # they stay queued
            self._wakeups.verify_at = workflow.now() + VERIFY_AGAIN_AFTER

    async def _continue_as_new(self) -> None:
        # Updates still running would be lost with this run: let them finish first.
        await workflow.wait_condition(workflow.all_handlers_finished)
        self._book.prune(workflow.now().date())
        self._book.runs += 1
        workflow.continue_as_new(ContractInput(terms=self._terms, state=self._book.to_state()))


CONTRACT_WORKFLOWS = [ContractWorkflow]
