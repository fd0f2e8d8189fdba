"""Whether a job is covered by the YOCO guarantee at a given moment: its opt-ins, opt-outs and
validations in time order (`JobCoverage`), and a contract's jobs with the rules that change their
coverage (`Jobs`). An outcome's ledger status depends on its job's coverage when the failure was
detected."""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from datetime import datetime
from typing import NamedTuple

from pydantic import AwareDatetime, Field

from torchpass.contract.entries import EntryStatus
from torchpass.contract.rules import validation_status
from torchpass.contract.terms import ContractRuleError, ContractTerms
from torchpass.errors import ErrorType
from torchpass.models import Model
from torchpass.validation.report import ValidationReport

# keys kept per job: one per run of it that a validation registered (a job resumed keeps its key)
MAX_KEYS = 8


class CoverageChange(NamedTuple):
    """From `at` on, the job is covered or not, for `status`'s reason (SUCCESS stands for
    covered)."""

    at: AwareDatetime
    status: EntryStatus


# An opt-in is recorded as "awaiting validation" from its time on, an opt-out as "opted out".
_OPT_MARKS = frozenset({EntryStatus.AWAITING_VALIDATION, EntryStatus.OPTED_OUT})


class JobCoverage(Model):
    """A job's opt-ins, opt-outs and validations, sorted by time: whether it was covered at any
    moment."""

    job_id: str
    changes: tuple[CoverageChange, ...] = ()
    keys: tuple[str, ...] = Field(
        default=(),
        max_length=MAX_KEYS,
        description="the public keys the job's genuine validations registered, the latest last: an "
        "outcome of the job counts only signed by one (torchpass.incident.attestation)",
    )

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


class Jobs:
    """A contract's jobs, each with its coverage, and the rules that change it; `check_*` only read.

    ContractBook keeps one; ContractWorkflow's opt-in, opt-out and validation updates act on it,
    calling `check_*` from their validators and the matching method from the handler."""

    def __init__(self, terms: ContractTerms, jobs: Iterable[JobCoverage] = ()) -> None:
        self.terms = terms
        self.coverage = {j.job_id: j for j in jobs}

    def status(self, job_id: str, t: datetime) -> EntryStatus:
        """SUCCESS when the job was covered at `t`, else why not (never opted in, for a job not
        known)."""
        job = self.coverage.get(job_id)
        return job.at(t) if job else EntryStatus.NOT_OPTED_IN

    def keys(self, job_id: str) -> tuple[str, ...]:
        """The keys the job's validations registered (none for a job not known)."""
        job = self.coverage.get(job_id)
        return job.keys if job else ()

    def covered(self, now: datetime) -> tuple[str, ...]:
        return tuple(j for j, cov in self.coverage.items() if cov.at(now) is EntryStatus.SUCCESS)

    def opt_in(self, job_id: str, now: datetime) -> JobCoverage:
        """Opt a job in from `now`: not covered until a validation passes. Opting in twice is a
        no-op."""
        job = self.coverage.get(job_id, JobCoverage(job_id=job_id))
        if job.opt_in_mark() is None:
            job = job.with_change(CoverageChange(now, EntryStatus.AWAITING_VALIDATION))
        self.coverage[job_id] = job
        return job

    def check_opted_in(self, job_id: str) -> CoverageChange:
        job = self.coverage.get(job_id)
        mark = job.opt_in_mark() if job else None
        if mark is None:
            raise ContractRuleError(
                ErrorType.CONTRACT_UNKNOWN_JOB, f"job {job_id!r} is not opted in"
            )
        return mark

    def opt_out(self, job_id: str, now: datetime) -> JobCoverage:
        self.check_opted_in(job_id)
        job = self.coverage[job_id].with_change(CoverageChange(now, EntryStatus.OPTED_OUT))
        self.coverage[job_id] = job
        return job

    def check_validation(self, report: ValidationReport) -> None:
        if report.contract_id != self.terms.contract_id:
            raise ContractRuleError(
                ErrorType.CONTRACT_WRONG_CONTRACT,
                f"report for contract {report.contract_id!r}, this is {self.terms.contract_id!r}",
            )
        self.check_opted_in(report.job_id)

    def record_validation(self, report: ValidationReport) -> JobCoverage:
        """A report covers (or uncovers) the job from its time, never before the opt-in it answers.
        One with waived checks covers it on a development contract only (`validation_status`)."""
        mark = self.check_opted_in(report.job_id)
        status = validation_status(report, self.terms.purpose)
        change = CoverageChange(max(report.validated_at, mark.at), status)
        job = self.coverage[report.job_id].with_change(change)
        if report.job_key is not None:
            keys = [k for k in job.keys if k != report.job_key][-(MAX_KEYS - 1) :]
            job = job.model_copy(update={"keys": (*keys, report.job_key)})
        self.coverage[report.job_id] = job
        return job
