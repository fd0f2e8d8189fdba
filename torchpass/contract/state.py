"""What a YOCO contract carries across continue-as-new: its running state (`ContractState`, which
`torchpass.contract.book.ContractBook` is built from and saved to), and ContractWorkflow's input,
the terms with that state."""

from __future__ import annotations

from datetime import date

from pydantic import AwareDatetime, Field, NonNegativeInt

from torchpass.contract.coverage import JobCoverage
from torchpass.contract.credit import CreditDelivery, CreditNotice, Money
from torchpass.contract.entries import DayRollup, LedgerEntry, RejectedClaim
from torchpass.contract.evaluation import Evaluation
from torchpass.contract.terms import ContractTerms, RenewInput
from torchpass.incident.outcome import MigrationOutcome
from torchpass.models import Model


class ContractState(Model):
    """Everything a contract carries across continue-as-new. The ledger holds only what a future
    window can still count (see `ContractBook.prune`)."""

    term: NonNegativeInt = 0
    term_start: date
    renewal_date: date
    annual_fee: Money
    renewal: RenewInput | None = Field(default=None, description="set once the customer renewed")
    awaiting_renewal: bool = Field(
        default=False,
        description="the term ending at renewal_date was evaluated without a renewal: a `renew` "
        "within terms.renewal_grace_days starts the next term from renewal_date, else the contract "
        "lapses",
    )
    jobs: tuple[JobCoverage, ...] = ()
    ledger: tuple[LedgerEntry, ...] = ()
    rollups: tuple[DayRollup, ...] = Field(
        default=(), description="the oldest days' entries, counted"
    )
    rolled_through: date | None = Field(
        default=None, description="the last day rolled up (none later)"
    )
    evaluations: tuple[Evaluation, ...] = ()
    pending_credits: tuple[CreditNotice, ...] = ()
    deliveries: tuple[CreditDelivery, ...] = ()
    credit_retry_at: AwareDatetime | None = Field(
        default=None, description="when a pending credit that billing did not take is offered again"
    )
    duplicates: NonNegativeInt = 0
    rejected_signals: NonNegativeInt = 0
    unverified: tuple[MigrationOutcome, ...] = Field(
        default=(),
        description="outcomes received and not yet checked against their incident workflows",
    )
    rejected: tuple[RejectedClaim, ...] = Field(
        default=(),
        description="the latest outcomes and validations refused as unverifiable, with why",
    )
    rejected_claims: NonNegativeInt = Field(default=0, description="every claim ever refused")
    pruned: NonNegativeInt = Field(
        default=0, description="entries dropped as too old for any window"
    )
    runs: NonNegativeInt = Field(default=0, description="continue-as-new count")
    rules_version: int = Field(
        default=1, description="bumped when the rules change; see docs/contract.md"
    )


class ContractInput(Model):
    """ContractWorkflow's input: the terms, and after a continue-as-new the state carried over."""

    terms: ContractTerms
    state: ContractState | None = None
