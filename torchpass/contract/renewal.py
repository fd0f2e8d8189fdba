"""The contract term running now and how it ends: renewed (on time, or late within the grace), or
lapsed.

A term runs from its first day to its renewal date (exclusive), at the annual fee in force. At the
renewal date ContractBook evaluates it (`ContractBook.close_term`); then the next term starts, or,
unrenewed, the contract awaits a late `renew` for `terms.renewal_grace_days` and lapses when they
pass without one.
"""

from __future__ import annotations

from datetime import date, datetime, timedelta

from torchpass.contract.rules import add_months, check_fee, day_start
from torchpass.contract.state import ContractState
from torchpass.contract.terms import ContractRuleError, ContractTerms, RenewInput
from torchpass.errors import ErrorType


class Term:
    """The term running now: its number (0 for the first), first day, renewal date and fee, and the
    renewal recorded for its end, if any; `check_*` only read, the rest change it. An expansion
    changes the fee."""

    def __init__(self, terms: ContractTerms, s: ContractState) -> None:
        self.grace_days = terms.renewal_grace_days
        self.number, self.start, self.renewal_date = s.term, s.term_start, s.renewal_date
        self.fee, self.renewal, self.awaiting_renewal = s.annual_fee, s.renewal, s.awaiting_renewal
        self.lapsed = False

    def check_renew(self, inp: RenewInput, today: date | None = None) -> None:
        """A renewal's fee is checked like an expansion's; its next renewal date must be after the
        coming (or, awaiting renewal, the passed) renewal date and, when given, after `today`."""
        if inp.annual_fee is not None:
            check_fee(self.fee, inp.annual_fee)
        if inp.next_renewal is None:
            return
        if inp.next_renewal <= self.renewal_date:
            raise ContractRuleError(
                ErrorType.CONTRACT_DATES_OUT_OF_ORDER,
                f"next renewal {inp.next_renewal} must be after the coming one, "
                f"{self.renewal_date}",
            )
        if today is not None and inp.next_renewal <= today:
            raise ContractRuleError(
                ErrorType.CONTRACT_DATES_OUT_OF_ORDER,
                f"next renewal {inp.next_renewal} must be after today, {today}",
            )

    def renew(self, inp: RenewInput, today: date | None = None) -> date:
        """Record the renewal due at `renewal_date`; the latest call wins. Returns the next renewal
        date.

        Awaiting renewal (the term was evaluated unrenewed, the grace has not passed), the renewal
        is late: the next term starts at once, retroactively from the passed renewal date."""
        self.check_renew(inp, today)
        self.renewal = inp
        if self.awaiting_renewal:
            self._start_next()
            return self.renewal_date
        return inp.next_renewal or add_months(self.renewal_date, 12)

    def _start_next(self) -> None:
        assert self.renewal is not None
        next_renewal = self.renewal.next_renewal or add_months(self.renewal_date, 12)
        self.fee = self.renewal.annual_fee or self.fee
        self.number, self.start, self.renewal_date = (
            self.number + 1,
            self.renewal_date,
            next_renewal,
        )
        self.renewal, self.awaiting_renewal = None, False

    def end(self) -> None:
        """The term was evaluated at its renewal date: the next one starts, or (not renewed) the
        contract awaits a late renewal, keeping this term and its dates."""
        if self.renewal is None:
            self.awaiting_renewal = True
            return
        self._start_next()

    def grace_ends(self) -> date:
        """The day (00:00 UTC) a contract awaiting renewal lapses: the renewal date plus the
        grace."""
        return self.renewal_date + timedelta(days=self.grace_days)

    def lapse_if_unrenewed(self, now: datetime) -> bool:
        """Awaiting renewal and the grace is over: the contract lapses. Returns whether it
        lapsed."""
        if self.awaiting_renewal and not self.lapsed and now >= day_start(self.grace_ends()):
            self.lapsed = True
        return self.lapsed
