"""The models of a YOCO contract: its terms, its compact ledger, its evaluations and its standing.

Pure data, shared by the rules (`torchpass.contract.rules`), ContractWorkflow and the client helpers. Contract
dates (start, renewal, expansion) are calendar `date`s read as 00:00 UTC of that day; events (an
incident's detection, an opt-in, a validation) are timezone-aware datetimes. A window ``[a, b)`` of dates
therefore holds the events detected from 00:00 UTC on ``a`` up to, not including, 00:00 UTC on ``b``.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field
from datetime import date, datetime
from decimal import Decimal
from enum import StrEnum
from typing import NamedTuple

from pydantic import AwareDatetime, Field, NonNegativeInt, model_validator

from torchpass.contract.credit import CreditDelivery, CreditNotice, Money
from torchpass.errors import ErrorType, TorchpassError
from torchpass.incident.outcome import MigrationOutcome
from torchpass.models import Model

_ID = r"^[A-Za-z0-9._:-]+$"


class ContractRuleError(TorchpassError, ValueError):
    """An input the contract rules refuse; `error_type` (a `Contract*` ErrorType) says which rule."""

    def __init__(self, error_type: ErrorType, message: str) -> None:
        super().__init__(message, error_type)


class ContractPurpose(StrEnum):
    """A customer contract is the guarantee; a development one (demos, tests) accepts waived validation
    checks and never issues a credit notice to billing (docs/contract.md)."""

    CUSTOMER = "customer"
    DEVELOPMENT = "development"


DEVELOPMENT_BANNER = "DEVELOPMENT contract: waivers accepted; not a customer guarantee; no credit to billing"


class ContractTerms(Model):
    """What a contract is created with (ContractWorkflow's start input, with `ContractInput`)."""

    customer_id: str = Field(min_length=1, max_length=200, pattern=_ID)
    contract_id: str = Field(min_length=1, max_length=200, pattern=_ID)
    start: date = Field(description="first day of the contract (00:00 UTC)")
    renewal_date: date = Field(description="end of the first term: the first evaluation at renewal")
    annual_fee: Money
    purpose: ContractPurpose = Field(
        default=ContractPurpose.CUSTOMER,
        description="development: a validation with waived checks covers a job, and no credit is issued",
    )
    continue_as_new_after: int = Field(
        default=2000, ge=5, le=50_000, description="history events handled before a run continues-as-new"
    )
    renewal_grace_days: int = Field(
        default=60,
        ge=0,
        le=366,
        description="days after a renewal date a late `renew` is still accepted (starting the next term "
        "from that date); the contract lapses when they pass without one. 0: lapse at the renewal",
    )

    @model_validator(mode="after")
    def _sane(self) -> ContractTerms:
        if self.annual_fee.amount <= 0:
            raise ValueError("annual_fee must be positive")
        if self.renewal_date <= self.start:
            raise ValueError("renewal_date must be after start")
        return self


class Trigger(StrEnum):
    RENEWAL = "renewal"
    EXPANSION = "expansion"


class EntryStatus(StrEnum):
    """Where one outcome stands in the ledger. Only SUCCESS and FAILURE count toward the rate."""

    SUCCESS = "success"
    FAILURE = "failure"
    NOT_A_FAILURE = "not_a_failure"
    NOT_OPTED_IN = "not_opted_in"
    AWAITING_VALIDATION = "awaiting_validation"
    VALIDATION_FAILED = "validation_failed"
    VALIDATION_WAIVED = "validation_waived"
    OPTED_OUT = "opted_out"
    SHARED_INFRASTRUCTURE = "shared_infrastructure"
    UNABLE_TO_RECOVER = "unable_to_recover"


COUNTED = frozenset({EntryStatus.SUCCESS, EntryStatus.FAILURE})

EXCLUSION_REASON: dict[EntryStatus, str] = {
    EntryStatus.NOT_A_FAILURE: "not a failure: the incident was a false alarm",
    EntryStatus.NOT_OPTED_IN: "job not covered: not opted in to the YOCO guarantee",
    EntryStatus.AWAITING_VALIDATION: "job not covered: opted in, environment not yet validated",
    EntryStatus.VALIDATION_FAILED: "job not covered: environment validation failed",
    EntryStatus.VALIDATION_WAIVED: "job not covered: validated with waived checks (development override), "
    "not accepted on a customer contract",
    EntryStatus.OPTED_OUT: "job not covered: opted out of the YOCO guarantee",
    EntryStatus.SHARED_INFRASTRUCTURE: "disqualifying event: shared infrastructure failure",
    EntryStatus.UNABLE_TO_RECOVER: "disqualifying event: unable to recover (includes no spare available)",
}


class LedgerEntry(NamedTuple):
    """One outcome as the contract keeps it: a JSON array, so that 10,000 a year fit one payload."""

    incident_id: str
    job_id: str
    detected_at: AwareDatetime
    status: EntryStatus
    late: bool = False
    duplicates: int = 0
    # MigrationOutcome.recovery_seconds rounded to milliseconds, so that `torchpass cost --contract` needs
    # only the ledger, not the incident workflows (which Temporal's retention deletes).
    recovery_seconds: float | None = None


class DayRollup(NamedTuple):
    """A UTC day's entries of one status counted, no longer listed (`torchpass.contract.ledger`): windows are
    whole days, so every tally over roll-ups is exact."""

    day: date
    status: EntryStatus
    entries: int
    late: int = 0
    duplicates: int = 0


class RejectedClaim(Model):
    """An outcome or a validation the contract refused because its workflow does not bear it out."""

    claim: str = Field(description="the incident id, or the validation workflow run, it named")
    job_id: str
    at: AwareDatetime = Field(description="the failure's detection, or when the report was refused")
    reason: str


class CoverageChange(NamedTuple):
    """From `at` on, the job is covered or not, for `status`'s reason (SUCCESS stands for covered)."""

    at: AwareDatetime
    status: EntryStatus


# An opt-in is recorded as "awaiting validation" from its time on, an opt-out as "opted out".
_OPT_MARKS = frozenset({EntryStatus.AWAITING_VALIDATION, EntryStatus.OPTED_OUT})


class JobCoverage(Model):
    """A job's opt-ins, opt-outs and validations, sorted by time: whether it was covered at any moment."""

    job_id: str
    changes: tuple[CoverageChange, ...] = ()

    def at(self, t: datetime) -> EntryStatus:
        """SUCCESS when opted in and validated at `t`, else the reason the job was not covered."""
        current = EntryStatus.NOT_OPTED_IN
        for change in self.changes:
            if change.at > t:
                break
            current = change.status
        return current

    def with_change(self, change: CoverageChange) -> JobCoverage:
        """One more change, kept sorted by time (ties keep the order they were recorded in)."""
        changes = list(self.changes)
        bisect.insort_right(changes, change, key=lambda c: c.at)
        return self.model_copy(update={"changes": tuple(changes)})

    def opt_in_mark(self) -> CoverageChange | None:
        """The opt-in in force, or None when the job is not (or no longer) opted in."""
        marks = [c for c in self.changes if c.status in _OPT_MARKS]
        return marks[-1] if marks and marks[-1].status is EntryStatus.AWAITING_VALIDATION else None


def coverage_of(job: JobCoverage | None, t: datetime) -> EntryStatus:
    return job.at(t) if job else EntryStatus.NOT_OPTED_IN


class OptInInput(Model):
    job_id: str = Field(min_length=1, max_length=200)


class ExpandInput(Model):
    """An expansion purchased on `on`; `annual_fee` is the whole annual fee from then on.

    The fee is not constrained here on purpose: the workflow's validator answers a bad one with a typed
    `ContractInvalidFee`, which a caller can act on."""

    on: date
    annual_fee: Money


class RenewInput(Model):
    """The customer renews at the coming renewal date; fee and next renewal default to the same terms."""

    annual_fee: Money | None = None
    next_renewal: date | None = None


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


class ContractState(Model):
    """Everything a contract carries across continue-as-new. The ledger holds only what a future window
    can still count (see `torchpass.contract.rules.prune`)."""

    term: NonNegativeInt = 0
    term_start: date
    renewal_date: date
    annual_fee: Money
    renewal: RenewInput | None = Field(default=None, description="set once the customer renewed")
    awaiting_renewal: bool = Field(
        default=False,
        description="the term ending at renewal_date was evaluated without a renewal: a `renew` within "
        "terms.renewal_grace_days starts the next term from renewal_date, else the contract lapses",
    )
    jobs: tuple[JobCoverage, ...] = ()
    ledger: tuple[LedgerEntry, ...] = ()
    rollups: tuple[DayRollup, ...] = Field(default=(), description="the oldest days' entries, counted")
    rolled_through: date | None = Field(default=None, description="the last day rolled up (none later)")
    evaluations: tuple[Evaluation, ...] = ()
    pending_credits: tuple[CreditNotice, ...] = ()
    deliveries: tuple[CreditDelivery, ...] = ()
    credit_retry_at: AwareDatetime | None = Field(
        default=None, description="when a pending credit that billing did not take is offered again"
    )
    duplicates: NonNegativeInt = 0
    rejected_signals: NonNegativeInt = 0
    unverified: tuple[MigrationOutcome, ...] = Field(
        default=(), description="outcomes received and not yet checked against their incident workflows"
    )
    rejected: tuple[RejectedClaim, ...] = Field(
        default=(), description="the latest outcomes and validations refused as unverifiable, with why"
    )
    rejected_claims: NonNegativeInt = Field(default=0, description="every claim ever refused")
    pruned: NonNegativeInt = Field(default=0, description="entries dropped as too old for any window")
    runs: NonNegativeInt = Field(default=0, description="continue-as-new count")
    rules_version: int = Field(default=1, description="bumped when the rules change; see docs/contract.md")


class ContractInput(Model):
    """ContractWorkflow's input: the terms, and after a continue-as-new the state carried over."""

    terms: ContractTerms
    state: ContractState | None = None


class LedgerPageInput(Model):
    offset: NonNegativeInt = 0
    limit: int = Field(default=200, ge=1, le=1000)


class LedgerRow(Model):
    incident_id: str
    job_id: str
    detected_at: AwareDatetime
    status: EntryStatus
    counted: bool
    reason: str | None = Field(description="why it is excluded from the rate; None when counted")
    late: bool
    duplicates: NonNegativeInt
    recovery_seconds: float | None = Field(default=None, description="failure observed -> training again")

    @classmethod
    def of(cls, e: LedgerEntry) -> LedgerRow:
        counted = e.status in COUNTED
        return cls(
            incident_id=e.incident_id,
            job_id=e.job_id,
            detected_at=e.detected_at,
            status=e.status,
            counted=counted,
            reason=None if counted else EXCLUSION_REASON[e.status],
            late=e.late,
            duplicates=e.duplicates,
            recovery_seconds=e.recovery_seconds,
        )


class LedgerPage(Model):
    purpose: ContractPurpose = ContractPurpose.CUSTOMER
    rows: tuple[LedgerRow, ...]
    total: NonNegativeInt
    next_offset: NonNegativeInt | None
    pruned: NonNegativeInt
    rolled_up: tuple[DayRollup, ...] = Field(
        default=(),
        description="the oldest entries, counted per day and status (the ledger passed its budget)",
    )
    rejected: tuple[RejectedClaim, ...] = Field(
        default=(), description="the latest claims refused as unverifiable, with why: never counted"
    )


class Standing(Model):
    """Where the contract stands now: the `standing` query's answer and the workflow's final result."""

    customer_id: str
    contract_id: str
    purpose: ContractPurpose = ContractPurpose.CUSTOMER
    term: NonNegativeInt
    term_start: date
    renewal_date: date
    annual_fee: Money
    renewed: bool
    awaiting_renewal: bool = Field(
        default=False,
        description="the term ended unrenewed: `renew` is still accepted until renewal_grace_ends",
    )
    renewal_grace_ends: date | None = Field(
        default=None, description="while awaiting renewal: the contract lapses at 00:00 UTC that day"
    )
    lapsed: bool = Field(default=False, description="ended unrenewed: the workflow's final standing")
    window_start: date
    window_end: date = Field(description="exclusive: the end of today")
    qualifying: NonNegativeInt
    successful: NonNegativeInt
    excluded: dict[EntryStatus, int]
    success_rate: Decimal | None
    summary: str
    projected_credit: Money | None
    next_evaluation: date | None
    covered_jobs: tuple[str, ...]
    evaluations: tuple[Evaluation, ...]
    pending_credits: NonNegativeInt
    next_credit_retry: AwareDatetime | None = Field(
        default=None, description="when pending credits are offered to billing again; None: at once"
    )
    delivered_credits: tuple[str, ...] = Field(description="idempotency keys billing acknowledged")
    duplicates: NonNegativeInt
    rejected_signals: NonNegativeInt
    unverified: NonNegativeInt = Field(default=0, description="outcomes awaiting their check")
    rejected_claims: NonNegativeInt = Field(
        default=0, description="outcomes and validations refused as unverifiable (see the ledger's rejected)"
    )
    runs: NonNegativeInt
