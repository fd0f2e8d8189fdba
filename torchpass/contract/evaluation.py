"""A YOCO contract's evaluations: what triggers one, the counts of a window, what an evaluation is
about besides the ledger, the closed evaluation with the credit it issued
(`torchpass.contract.rules.evaluate` makes one), and a contract's record of them with the credits
owed until billing has them (`Evaluations`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import date, datetime
from decimal import Decimal
from enum import StrEnum

from pydantic import Field, NonNegativeInt

from torchpass.contract.credit import CreditDelivery, CreditNotice, Money
from torchpass.contract.entries import EntryStatus
from torchpass.contract.terms import ContractPurpose
from torchpass.models import Model


class Trigger(StrEnum):
    RENEWAL = "renewal"
    EXPANSION = "expansion"


class Evaluation(Model):
    """One closed evaluation, at a renewal or an expansion. Never re-opened."""

    trigger: Trigger
    term: NonNegativeInt = Field(description="contract year, 0 for the first")
    period_start: date
    period_end: date = Field(description="the evaluation date, exclusive")
    evaluated: bool = Field(description="False for an expansion measured over under 3 months")
    qualifying: NonNegativeInt = 0
    successful: NonNegativeInt = 0
    excluded: NonNegativeInt = 0
    success_rate: Decimal | None = Field(
        default=None, description="floored to 6 places; None: no events"
    )
    credit_period_start: date | None = Field(
        default=None,
        description="where the outcomes the credit decision counts begin: the period start, or the "
        "end of the last evaluation that issued a credit when that is later (the same failures are "
        "never paid twice); None when not evaluated",
    )
    credit_qualifying: NonNegativeInt = Field(
        default=0, description="qualifying since credit_period_start"
    )
    credit_successful: NonNegativeInt = Field(
        default=0, description="successful since credit_period_start"
    )
    fee: Money = Field(description="the annual fee the credit is a share of")
    credit: CreditNotice | None = None
    note: str


@dataclass
class Tally:
    """Counts of one window: what the rate is made of, and the excluded by reason."""

    qualifying: int = 0
    successful: int = 0
    excluded: Counter[EntryStatus] = field(default_factory=Counter)


@dataclass(frozen=True)
class EvaluationContext:
    """What an evaluation is about, besides the ledger."""

    customer_id: str
    contract_id: str
    contract_start: date
    term: int
    trigger: Trigger
    period_end: date
    fee: Money
    apply_to: str
    credit_already_this_term: bool
    now: datetime
    credited_through: date | None = None  # period_end of the last evaluation that issued a credit
    # a development contract never issues a credit
    purpose: ContractPurpose = ContractPurpose.CUSTOMER


class Evaluations:
    """A contract's closed evaluations, and the credits they issued: pending until billing
    acknowledges one (then a delivery). `credit_retry_at` is when a pending credit billing did not
    take is offered again; ContractWorkflow sets it.

    The credit rules that look back (once per contract year, never twice for the same failures) read
    the evaluations, which travel whole across continue-as-new and are never pruned."""

    def __init__(
        self,
        closed: Iterable[Evaluation] = (),
        pending_credits: Iterable[CreditNotice] = (),
        deliveries: Iterable[CreditDelivery] = (),
        credit_retry_at: datetime | None = None,
    ) -> None:
        self.closed = list(closed)
        self.pending_credits = list(pending_credits)
        self.deliveries = list(deliveries)
        self.credit_retry_at = credit_retry_at

    def add(self, ev: Evaluation) -> Evaluation:
        """A closed evaluation; its credit, if any, is owed from now on."""
        self.closed.append(ev)
        if ev.credit is not None:
            self.pending_credits.append(ev.credit)
        return ev

    def evaluated_on(self, day: date) -> bool:
        """Whether an evaluation (evaluated or not) already closed on `day`."""
        return day in {e.period_end for e in self.closed}

    def last_evaluated(self) -> date | None:
        return max((e.period_end for e in self.closed if e.evaluated), default=None)

    def last_credited(self) -> date | None:
        """The end of the last evaluation that issued a credit: outcomes before it were paid for."""
        return max((e.period_end for e in self.closed if e.credit), default=None)

    def credited_in(self, term: int) -> bool:
        return any(e.credit and e.term == term for e in self.closed)

    def delivered(self, delivery: CreditDelivery) -> None:
        self.pending_credits = [
            c for c in self.pending_credits if c.idempotency_key != delivery.idempotency_key
        ]
        self.deliveries.append(delivery)
        if not self.pending_credits:
            self.credit_retry_at = None
