"""When ContractWorkflow's main loop wakes on its own, and the durable timer it sleeps on meanwhile.

The contract wakes for the close of its term (the renewal date plus `RENEWAL_SETTLE`), or, awaiting
a late renewal, for the end of the grace; for a pending credit's next offer to billing; and for the
next check of queued outcomes after one could not run. Everything else (an update, a signal, a
continue-as-new suggested) wakes it through the condition its wait is given.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import datetime, timedelta

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from torchpass.contract.book import ContractBook
    from torchpass.contract.rules import day_start

# An incident's outcome reaches the contract when its workflow ends: seconds after a live migration,
# up to the fallback restart's 15-minute bound otherwise.
RENEWAL_SETTLE = timedelta(minutes=20)


class Wakeups:
    """What the contract is due to do now, and the wait until the next of it."""

    def __init__(self, book: ContractBook) -> None:
        self._book = book
        self._timer: asyncio.Task[None] | None = None  # the durable timer of the next wake-up ...
        self._timer_at: datetime | None = None  # ... and its time
        # when queued outcomes are checked again after a failure
        self.verify_at: datetime | None = None

    def renewal_due(self) -> bool:
        term = self._book.term
        return not term.lapsed and not term.awaiting_renewal and workflow.now() >= self.closes_at()

    def closes_at(self) -> datetime:
        """When the term is evaluated: its renewal date (the evaluated period's end) plus a settling
        time, so that an incident detected just before midnight, whose outcome arrives minutes
        later, is counted in the term it belongs to instead of no term at all."""
        return day_start(self._book.term.renewal_date) + RENEWAL_SETTLE

    def deadline(self) -> datetime:
        """The next wake-up of the contract itself: the term's close, or, awaiting a late renewal,
        the end of the grace (a `renew` meanwhile moves it to the next term's close)."""
        if self._book.term.awaiting_renewal:
            return day_start(self._book.term.grace_ends())
        return self.closes_at()

    def delivery_due(self) -> bool:
        credits = self._book.evaluations
        retry_at = credits.credit_retry_at
        return bool(credits.pending_credits) and (retry_at is None or workflow.now() >= retry_at)

    def verify_due(self) -> bool:
        at = self.verify_at
        return bool(self._book.checks.unverified) and (at is None or workflow.now() >= at)

    def next_wake(self) -> datetime | None:
        # Once the contract lapsed there is no renewal to wake for (only a credit retry, if any).
        wakes = [] if self._book.term.lapsed else [self.deadline()]
        if self._book.evaluations.pending_credits:
            wakes.append(self._book.evaluations.credit_retry_at or workflow.now())
        if self._book.checks.unverified and self.verify_at is not None:
            wakes.append(self.verify_at)
        return min(wakes, default=None)

    async def wait(self, condition: Callable[[], bool]) -> None:
        """Until `condition` holds, or the next renewal or credit retry is due (a durable timer).

        The timer is never cancelled: one is started per wake-up time and left to fire, even when
        the condition comes first. So no completion carries a CancelTimer, which matters for
        continue-as-new: the time-skipping test server wedges a run whose [CancelTimer,
        ContinueAsNew] completion it refused for a signal that arrived meanwhile
        (temporalio/sdk-java#3088)."""
        at = self.next_wake()
        if at is None:
            await workflow.wait_condition(condition)
            return
        if at <= workflow.now():
            return
        if self._timer is None or self._timer_at != at:
            self._timer, self._timer_at = (
                asyncio.create_task(workflow.sleep(at - workflow.now())),
                at,
            )
        timer = self._timer
        # A late `renew` moves the wake-up from the grace's end to the next term's close, which may
        # be sooner: wake to start that timer instead of sleeping through it.
        await workflow.wait_condition(lambda: condition() or timer.done() or self.next_wake() != at)
