"""`torchpass audit`: a contract's ledger recomputed from the workflows' own histories and the jobs'
signatures, apart from the ContractWorkflow's state, and every row where the two disagree.

What the audit reads (`torchpass.cli.audit` gathers it): every validation run that asked to record a
report on the contract, and every incident run that signalled an outcome to it. It judges them with
the contract's own rules (`torchpass.contract.verify`): a validation counts when it ran on the
control worker's queue and its job proved its key; an outcome when its history bears it out and a
key its job proved signed it. Coverage at a failure is the latest such validation before it. Opt-ins
and opt-outs live only in the contract (an update, not a workflow of their own): where no validation
covers a job, the ledger's "not opted in" or "awaiting validation" stands, and so does an "opted
out". The same failure told by two runs counts once, the first detected.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import date, datetime

from torchpass.contract.entries import COUNTED, EntryStatus
from torchpass.contract.queries import LedgerRow
from torchpass.contract.rules import day_start, status_for, validation_status
from torchpass.contract.terms import ContractPurpose
from torchpass.contract.verify import (
    IncidentFacts,
    ValidationFacts,
    judge_outcome,
    judge_validation,
)
from torchpass.incident.outcome import MigrationOutcome
from torchpass.models import Model
from torchpass.validation.report import ValidationReport

# What only the contract knows: the audit takes its word for these when no validation says more.
_OPT_RECORD = frozenset(
    {EntryStatus.NOT_OPTED_IN, EntryStatus.AWAITING_VALIDATION, EntryStatus.OPTED_OUT}
)


class Finding(Model):
    """One incident where the ledger and the audit disagree."""

    incident_id: str
    job_id: str
    ledger: EntryStatus | None = None  # None: not in the ledger
    audit: EntryStatus | None = None  # None: no genuine incident of this contract bears it out
    why: str


class Audit(Model):
    findings: tuple[Finding, ...]
    incidents: int  # incident runs of this contract the audit judged
    validations: int  # genuine validations of this contract found
    qualifying: int  # in the window, as recomputed
    successful: int


class Validations:
    """The contract's genuine validations: each job's proven keys and its coverage over time."""

    def __init__(
        self,
        found: Iterable[tuple[ValidationReport, ValidationFacts]],
        contract_id: str,
        purpose: ContractPurpose,
        control_queue: str,
        enrolment_key: str | None = None,
    ) -> None:
        self.keys: dict[str, list[str]] = {}
        self.changes: dict[str, list[tuple[datetime, EntryStatus]]] = {}
        self.count = 0
        for report, facts in found:
            if report.contract_id != contract_id:
                continue
            if not judge_validation(report, facts, control_queue, enrolment_key).accepted:
                continue
            self.count += 1
            if report.job_key:
                self.keys.setdefault(report.job_id, []).append(report.job_key)
            change = (report.validated_at, validation_status(report, purpose))
            self.changes.setdefault(report.job_id, []).append(change)
        for changes in self.changes.values():
            changes.sort(key=lambda c: c[0])

    def coverage(self, job_id: str, at: datetime) -> EntryStatus | None:
        """What the latest genuine validation before `at` made of the job; None: none did."""
        status = None
        for when, s in self.changes.get(job_id, ()):
            if when > at:
                break
            status = s
        return status


def audited_status(
    outcome: MigrationOutcome,
    facts: IncidentFacts,
    validations: Validations,
    ledger: EntryStatus | None,
) -> tuple[EntryStatus | None, str]:
    """The status the contract's rules give `outcome` from the histories, or None and why not."""
    verdict = judge_outcome(outcome, facts, validations.keys.get(outcome.job_id, ()))
    if not verdict.accepted:
        return None, verdict.reason
    covered = validations.coverage(outcome.job_id, outcome.detected_at)
    if ledger is EntryStatus.OPTED_OUT or (covered is None and ledger in _OPT_RECORD):
        coverage = ledger
    else:
        coverage = covered or EntryStatus.NOT_OPTED_IN
    status = status_for(outcome, coverage)
    if status in COUNTED and not verdict.attested:
        return EntryStatus.UNCONFIRMED, verdict.reason
    return status, ""


def audit(
    rows: Sequence[LedgerRow],
    incidents: Sequence[tuple[MigrationOutcome, IncidentFacts]],
    validations: Validations,
    window: tuple[date, date],
    rolled_up: Iterable[date] = (),
) -> Audit:
    """Every disagreement between the ledger's `rows` and the `incidents`' histories, and the rate's
    counts over `window` (the standing's trailing window) as recomputed. An incident of a day the
    ledger keeps only as counts (`rolled_up`) has no row to compare: it is counted, not compared."""
    counted_only = set(rolled_up)
    ledger = {r.incident_id: r for r in rows}
    findings: list[Finding] = []
    audited: dict[str, EntryStatus] = {}
    first_of: dict[str, str] = {}  # failure key -> the incident counted for it
    for outcome, facts in sorted(incidents, key=lambda i: (i[0].detected_at, i[0].incident_id)):
        row = ledger.get(outcome.incident_id)
        status, why = audited_status(outcome, facts, validations, row.status if row else None)
        key = judge_outcome(outcome, facts).failure_key
        if status is not None and key is not None:
            first = first_of.setdefault(key, outcome.incident_id)
            if first != outcome.incident_id:
                status, why = None, f"the same failure as incident {first}, counted once"
        if status is not None:
            audited[outcome.incident_id] = status
        if row is None and status is not None and outcome.detected_at.date() not in counted_only:
            findings.append(_finding(outcome, None, status, "missing from the ledger"))
        elif row is not None and row.status != status:
            findings.append(_finding(outcome, row.status, status, why or "another status"))
    seen = {o.incident_id for o, _ in incidents}
    for r in rows:
        if r.incident_id not in seen:
            why = "no incident run of this contract bears it out"
            findings.append(
                Finding(incident_id=r.incident_id, job_id=r.job_id, ledger=r.status, why=why)
            )
    lo, hi = day_start(window[0]), day_start(window[1])
    in_window = [
        s for o, _ in incidents if (s := audited.get(o.incident_id)) and lo <= o.detected_at < hi
    ]
    return Audit(
        findings=tuple(findings),
        incidents=len(seen),
        validations=validations.count,
        qualifying=sum(s in COUNTED for s in in_window),
        successful=sum(s is EntryStatus.SUCCESS for s in in_window),
    )


def _finding(
    o: MigrationOutcome, ledger: EntryStatus | None, audited: EntryStatus | None, why: str
) -> Finding:
    return Finding(
        incident_id=o.incident_id, job_id=o.job_id, ledger=ledger, audit=audited, why=why
    )
