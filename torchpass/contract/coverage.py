"""Whether a job is covered by the YOCO guarantee at a given moment: its opt-ins, opt-outs and validations in
time order. An outcome's ledger status depends on its job's coverage when the failure was detected."""

from __future__ import annotations

import bisect
from datetime import datetime
from typing import NamedTuple

from pydantic import AwareDatetime

from torchpass.contract.entries import EntryStatus
from torchpass.models import Model


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
