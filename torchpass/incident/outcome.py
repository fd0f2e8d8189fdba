"""The record of one incident (`MigrationOutcome`): what the contract counts and what an SRE
reads."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from pydantic import AwareDatetime, Field, NonNegativeInt, field_validator

from torchpass.incident.steps import (
    ConfirmResult,
    FallbackResult,
    IncidentRef,
    RejoinResult,
    TransferProof,
)
from torchpass.models import (
    Classification,
    Disposition,
    Evidence,
    FailureKind,
    Model,
    Phase,
    PhaseTiming,
)

MAX_INCIDENT_ID = 1100  # Temporal's workflow ids are at most 1000 characters, a run id 36
MAX_ERROR = 4000


def bounded_error(text: str | None) -> str | None:
    """An error as an outcome keeps it: the start and the end of a long one."""
    if text is None or len(text) <= MAX_ERROR:
        return text
    half = MAX_ERROR // 2 - 10
    return f"{text[:half]} [...] {text[-half:]}"


class MigrationOutcome(Model):
    """The record of one incident: what billing counts and what an SRE reads."""

    incident_id: str = Field(
        min_length=1, max_length=MAX_INCIDENT_ID, description="workflow id/run id"
    )
    job_id: str = Field(min_length=1, max_length=200)
    failure_domain: str = Field(min_length=1, max_length=200)
    kind: FailureKind
    evidence_count: NonNegativeInt
    classification: Classification
    covered: bool = Field(
        description="the job runs under a YOCO contract (see ConfirmResult.covered)"
    )
    disposition: Disposition
    success: bool = Field(description="live-migrated: no restart, no rollback, no recomputed step")
    lost_slots: tuple[NonNegativeInt, ...] = ()
    steps_recomputed: NonNegativeInt = Field(
        default=0,
        description="completed steps run again, measured from the ranks' own step reports",
    )
    step_before: int | None = Field(
        default=None, description="last step any rank completed before it"
    )
    resumed_steps: dict[int, int] = Field(
        default_factory=dict,
        description="slot -> the first step each rank reported entering after it",
    )
    phases: tuple[PhaseTiming, ...] = ()
    proof: TransferProof | None = None
    fallback: FallbackResult | None = None
    error: str | None = Field(default=None, max_length=MAX_ERROR)
    detected_at: AwareDatetime
    recovered_at: AwareDatetime | None = None
    recovery_seconds: float | None = Field(
        default=None, description="failure observed -> training again"
    )
    last_progress_at: AwareDatetime | None = Field(
        default=None, description="a hang: when the hung rank last made progress (before detection)"
    )
    recovery_from_last_progress_seconds: float | None = Field(
        default=None,
        description="a hang: last progress -> training again (the hang timeout included)",
    )
    attestation: str | None = Field(
        default=None,
        max_length=128,
        description="the job's Ed25519 signature over the outcome's facts (hex): the ledger counts "
        "an outcome only with it (torchpass.incident.attestation)",
    )
    handled_locally: bool = Field(
        default=False,
        description="the job carried the steps out itself (no workflow step reached it in time); "
        "the workflow filed its record later, re-checked and classified on the control worker",
    )

    @field_validator("phases")
    @classmethod
    def _phases_unique(cls, phases: tuple[PhaseTiming, ...]) -> tuple[PhaseTiming, ...]:
        names = [p.phase for p in phases]
        if len(names) != len(set(names)):
            raise ValueError(f"phase listed twice: {names}")
        return phases


class CompleteInput(Model):
    incident: IncidentRef
    outcome: MigrationOutcome


class IncidentStatus(Model):
    """What MigrationWorkflow's `status` query answers while the incident runs."""

    phase: str
    evidence_count: NonNegativeInt
    disposition: Disposition | None = None
    job_id: str = Field(default="", description="the job whose incident it is (its first report's)")
    job_task_queue: str = Field(default="", description="where its job-side activities go")


@dataclass(frozen=True)
class Ending:
    """How an incident ended, as the job measured it, before it becomes a `MigrationOutcome`."""

    disposition: Disposition
    proof: TransferProof | None = None
    rejoin: RejoinResult | None = None
    fallback: FallbackResult | None = None
    error: str | None = None


def _seconds(a: datetime, b: datetime | None) -> float | None:
    return None if b is None else max(0.0, (b - a).total_seconds())


def build_outcome(
    incident_id: str,
    evidence: Sequence[Evidence],
    kind: FailureKind,
    classification: Classification,
    confirm: ConfirmResult | None,
    ending: Ending,
    started_at: datetime,
    phases: Sequence[PhaseTiming],
) -> MigrationOutcome:
    """The record of an incident: every figure is the job's measurement or the workflow's own clock.

    Steps recomputed, the step before and the steps the ranks resumed at come from the rejoin or the
    fallback (the ranks' own step reports); success needs a live migration with none recomputed. For
    a hang, recovery is also timed from the rank's last progress, so the hang timeout is not
    hidden."""
    first = evidence[0]
    detected = min(e.observed_at for e in evidence)
    progressed = [e.last_progress_at for e in evidence if e.last_progress_at is not None]
    last_progress = min(progressed) if progressed else None
    resumed = ending.rejoin or ending.fallback
    recovered = resumed.resumed_at if resumed is not None else None
    recomputed = resumed.steps_recomputed if resumed is not None else 0
    if ending.rejoin is not None:
        step_before = ending.rejoin.step_before
    else:
        step_before = ending.fallback.failed_at_step if ending.fallback is not None else None
    lost_during = ending.proof.lost_during if ending.proof is not None else ()
    # every rank holds the moved state, yet the run differs: per-rank state no replica held
    inexact = ending.rejoin.inexact if ending.rejoin is not None else None
    detect = PhaseTiming(
        phase=Phase.DETECT, seconds=max(0.0, (started_at - detected).total_seconds())
    )
    return MigrationOutcome(
        incident_id=incident_id,
        job_id=first.job_id,
        failure_domain=first.failure_domain,
        kind=kind,
        evidence_count=len(evidence),
        classification=classification,
        covered=confirm.covered if confirm else False,
        disposition=ending.disposition,
        success=ending.disposition is Disposition.MIGRATED and recomputed == 0 and not inexact,
        # What confirm found, and what the recovery lost on the way and re-planned around (the
        # proof's).
        lost_slots=tuple(sorted({*(confirm.lost_slots if confirm else ()), *lost_during})),
        steps_recomputed=recomputed,
        step_before=step_before,
        resumed_steps=dict(resumed.resumed_steps) if resumed is not None else {},
        phases=(detect, *phases),
        proof=ending.proof,
        fallback=ending.fallback,
        error=bounded_error("; ".join(e for e in (ending.error, inexact) if e) or None),
        detected_at=detected,
        recovered_at=recovered,
        recovery_seconds=_seconds(detected, recovered),
        last_progress_at=last_progress,
        recovery_from_last_progress_seconds=_seconds(last_progress, recovered)
        if last_progress
        else None,
    )
