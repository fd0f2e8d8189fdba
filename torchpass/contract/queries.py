"""What a YOCO contract answers about itself: its standing (the `standing` query, `renew`'s answer
and ContractWorkflow's final result) and its ledger, page by page (the `ledger` query), each row
with why it is counted or not."""

from __future__ import annotations

from datetime import date
from decimal import Decimal

from pydantic import AwareDatetime, Field, NonNegativeInt

from torchpass.contract.credit import Money
from torchpass.contract.entries import (
    COUNTED,
    EXCLUSION_REASON,
    DayRollup,
    EntryStatus,
    LedgerEntry,
    RejectedClaim,
)
from torchpass.contract.evaluation import Evaluation
from torchpass.contract.terms import ContractPurpose
from torchpass.models import Model


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
    recovery_seconds: float | None = Field(
        default=None, description="failure observed -> training again"
    )

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
    """Where the contract stands now: the `standing` query's answer and the workflow's final
    result."""

    customer_id: str
    contract_id: str
    purpose: ContractPurpose = ContractPurpose.CUSTOMER
    enrolment_key: str | None = Field(
        default=None, description="the cluster's enrolment key the contract names (see its terms)"
    )
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
        default=None,
        description="while awaiting renewal: the contract lapses at 00:00 UTC that day",
    )
    lapsed: bool = Field(
        default=False, description="ended unrenewed: the workflow's final standing"
    )
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
        default=0,
        description="outcomes and validations refused as unverifiable (see the ledger's rejected)",
    )
    runs: NonNegativeInt
