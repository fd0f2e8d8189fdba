"""A contract's ledger: its entries one by one, within a budget that fits one continue-as-new
payload.

Pure, like the rules. Past the budget (`LEDGER_BUDGET` entries or about `LEDGER_BYTES` of them;
Temporal refuses a payload over 2 MB) the oldest whole days are rolled up to counts, one `DayRollup`
per UTC day and status. Windows begin and end on day boundaries, so every tally is what the whole
ledger would give. What a roll-up forgets is who was counted: an outcome of a rolled-up day can no
longer be told from a duplicate.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, date, datetime, timedelta

from torchpass.contract.entries import DayRollup, LedgerEntry
from torchpass.contract.rules import day_start
from torchpass.contract.verify import split_run

LEDGER_BUDGET = 10_000
LEDGER_BYTES = 1_000_000
# from the newest entry: days an outcome of which may still arrive
ROLLUP_MIN_AGE = timedelta(days=2)
_ENTRY_OVERHEAD = 120  # bytes of one entry's JSON beyond its two ids


def _size(e: LedgerEntry) -> int:
    return len(e.incident_id) + len(e.job_id) + _ENTRY_OVERHEAD


class Ledger:
    def __init__(
        self,
        entries: Iterable[LedgerEntry],
        rollups: Iterable[DayRollup],
        rolled_through: date | None,
    ) -> None:
        self.entries = {e.incident_id: e for e in entries}  # insertion order is recording order
        self.rollups = {(r.day, r.status): r for r in rollups}
        self.rolled_through = rolled_through
        self._bytes = sum(_size(e) for e in self.entries.values())
        # An incident's workflow id is its failure (job, failure domain, generation): run ->
        # incident id.
        self.failures = {split_run(k)[0]: k for k in self.entries}

    def too_late(self, detected_at: datetime) -> bool:
        """Whether `detected_at` falls on a day already rolled up."""
        last = self.rolled_through
        return last is not None and detected_at < day_start(last + timedelta(days=1))

    def add(self, entry: LedgerEntry) -> None:
        self.entries[entry.incident_id] = entry
        self._bytes += _size(entry)
        self.failures.setdefault(split_run(entry.incident_id)[0], entry.incident_id)
        self.roll_up()

    def _drop(self, incident_id: str) -> LedgerEntry:
        e = self.entries.pop(incident_id)
        self._bytes -= _size(e)
        if self.failures.get(split_run(incident_id)[0]) == incident_id:
            del self.failures[split_run(incident_id)[0]]
        return e

    def roll_up(self) -> int:
        """Past the budget, roll the oldest whole days (never the latest two) up to counts, down to
        90% of it; returns how many entries went."""
        if len(self.entries) <= LEDGER_BUDGET and self._bytes <= LEDGER_BYTES:
            return 0
        by_age = sorted(self.entries.values(), key=lambda e: e.detected_at)
        keep_from = by_age[-1].detected_at.astimezone(UTC).date() - ROLLUP_MIN_AGE
        gone = 0
        for e in by_age:
            day = e.detected_at.astimezone(UTC).date()
            under = len(self.entries) <= 0.9 * LEDGER_BUDGET and self._bytes <= 0.9 * LEDGER_BYTES
            last = self.rolled_through
            if day >= keep_from or (under and (last is None or day > last)):
                break  # a day is rolled up whole, never split between counts and entries
            r = self.rollups.get((day, e.status), DayRollup(day, e.status, 0))
            self.rollups[(day, e.status)] = r._replace(
                entries=r.entries + 1, late=r.late + e.late, duplicates=r.duplicates + e.duplicates
            )
            self._drop(e.incident_id)
            self.rolled_through = max(day, last or day)
            gone += 1
        return gone

    def prune(self, cutoff: datetime) -> int:
        """Drop what was detected before `cutoff`, entries and roll-ups; returns how many entries
        went."""
        old = [k for k, e in self.entries.items() if e.detected_at < cutoff]
        for k in old:
            self._drop(k)
        gone = [key for key, r in self.rollups.items() if day_start(r.day) < cutoff]
        return len(old) + sum(self.rollups.pop(key).entries for key in gone)

    def counted(self) -> list[LedgerEntry | DayRollup]:
        """What a window tallies: every entry and every day's roll-up."""
        return [*self.entries.values(), *self.rollups.values()]
