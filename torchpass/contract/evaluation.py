"""A YOCO contract's evaluations: what triggers one, the counts of a window, what an evaluation is about
besides the ledger, and the closed evaluation with the credit it issued (`torchpass.contract.rules.evaluate`
makes one)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import date, datetime
from decimal import Decimal
from enum import StrEnum

from pydantic import Field, NonNegativeInt

from torchpass.contract.credit import CreditNotice, Money
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
    success_rate: Decimal | None = Field(default=None, description="floored to 6 places; None: no events")
    credit_period_start: date | None = Field(
        default=None,
        description="where the outcomes the credit decision counts begin: the period start, or the end of "
        "the last evaluation that issued a credit when that is later (the same failures are never paid "
        "twice); None when not evaluated",
    )
    credit_qualifying: NonNegativeInt = Field(default=0, description="qualifying since credit_period_start")
    credit_successful: NonNegativeInt = Field(default=0, description="successful since credit_period_start")
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
    purpose: ContractPurpose = ContractPurpose.CUSTOMER  # a development contract never issues a credit
