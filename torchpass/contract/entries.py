"""What a YOCO contract's ledger holds: the status of each outcome (and why one is not counted), its
compact entry, a UTC day's entries rolled up to counts, and the claims the contract refused.

Entries are tuples, not models, so that a year of them fits one continue-as-new payload
(`torchpass.contract.ledger` keeps them within that budget).
"""

from __future__ import annotations

from datetime import date
from enum import StrEnum
from typing import NamedTuple

from pydantic import AwareDatetime, Field

from torchpass.models import Model


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
    # Its incident workflow is genuine, but the job never signed its facts
    # (`torchpass.incident.attestation`): the job never confirmed it, or gave other figures.
    UNCONFIRMED = "unconfirmed"


COUNTED = frozenset({EntryStatus.SUCCESS, EntryStatus.FAILURE})

EXCLUSION_REASON: dict[EntryStatus, str] = {
    EntryStatus.NOT_A_FAILURE: "not a failure: the incident was a false alarm",
    EntryStatus.NOT_OPTED_IN: "job not covered: not opted in to the YOCO guarantee",
    EntryStatus.AWAITING_VALIDATION: "job not covered: opted in, environment not yet validated",
    EntryStatus.VALIDATION_FAILED: "job not covered: environment validation failed",
    EntryStatus.VALIDATION_WAIVED: "job not covered: validated with waived checks (development "
    "override), not accepted on a customer contract",
    EntryStatus.OPTED_OUT: "job not covered: opted out of the YOCO guarantee",
    EntryStatus.SHARED_INFRASTRUCTURE: "disqualifying event: shared infrastructure failure",
    EntryStatus.UNABLE_TO_RECOVER: "disqualifying event: unable to recover (includes no spare "
    "available)",
    EntryStatus.UNCONFIRMED: "unconfirmed: the job never attested this outcome (it never confirmed "
    "the incident, or its figures differ from the job's own)",
}


class LedgerEntry(NamedTuple):
    """One outcome as the contract keeps it: a JSON array, so that 10,000 a year fit one payload."""

    incident_id: str
    job_id: str
    detected_at: AwareDatetime
    status: EntryStatus
    late: bool = False
    duplicates: int = 0
    # MigrationOutcome.recovery_seconds rounded to milliseconds, so that `torchpass cost --contract`
    # needs only the ledger, not the incident workflows (which Temporal's retention deletes).
    recovery_seconds: float | None = None


class DayRollup(NamedTuple):
    """A UTC day's entries of one status counted, no longer listed (`torchpass.contract.ledger`):
    windows are whole days, so every tally over roll-ups is exact."""

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
