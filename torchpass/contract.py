"""The YOCO contract rules, as pure functions: no Temporal, no clock, no I/O.

Success rate = successful qualifying migrations / total qualifying migrations detected in the trailing 12
months before the evaluation date (never before the contract start). Evaluations happen at each renewal
and at each expansion; an expansion in the first contract year is evaluated only when at least 3 months
were measured. A rate below 90% (compared exactly, as fractions) earns a credit of 25% of the annual fee,
at most once per contract year, and never twice for the same failures: the outcomes detected since the
last evaluation that issued a credit must on their own be below 90% too (`credit_start`). The open cases
the product brief leaves are decided in docs/contract.md.

`ContractBook` applies these rules to a contract's running state; ContractWorkflow holds one and feeds
it the time (`workflow.now()`), so that everything here stays deterministic and unit-testable.
"""

from __future__ import annotations

import calendar
from collections.abc import Iterable
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from fractions import Fraction

from torchpass.contract_models import (
    COUNTED,
    ContractErrorType,
    ContractRuleError,
    ContractState,
    ContractTerms,
    CoverageChange,
    EntryStatus,
    Evaluation,
    EvaluationContext,
    ExpandInput,
    JobCoverage,
    LedgerEntry,
    LedgerPage,
    LedgerPageInput,
    LedgerRow,
    RenewInput,
    Standing,
    Tally,
    Trigger,
    coverage_of,
)
from torchpass.credit import CreditDelivery, CreditNotice, Money, credit_idempotency_key
from torchpass.models import Category, Disposition, MigrationOutcome
from torchpass.validation import ValidationReport

TARGET_RATE = Fraction(9, 10)
CREDIT_SHARE = Decimal("0.25")
WINDOW_MONTHS = 12
FIRST_YEAR_MIN_MONTHS = 3
# Billing may report an expansion some days after it was bought; not further back than this, so that the
# ledger can drop what no future window will count.
EXPANSION_BACKDATE_LIMIT = timedelta(days=31)
RATE_PLACES = 6


def add_months(d: date, months: int) -> date:
    """The same day `months` later (or earlier), clamped to the month's end (Feb 29 -> Feb 28)."""
    y, m = divmod(d.month - 1 + months, 12)
    year, month = d.year + y, m + 1
    return date(year, month, min(d.day, calendar.monthrange(year, month)[1]))


def day_start(d: date) -> datetime:
    """00:00 UTC of a contract date: where a window of dates begins or ends."""
    return datetime.combine(d, time(), tzinfo=UTC)


def window_for(contract_start: date, period_end: date) -> tuple[date, date]:
    """The trailing 12 months before `period_end`, never reaching before the contract started."""
    return max(contract_start, add_months(period_end, -WINDOW_MONTHS)), period_end


def expansion_measured_enough(contract_start: date, on: date) -> bool:
    """First-year expansions need 3 months measured (start -> expansion); later ones always count."""
    in_first_year = on < add_months(contract_start, 12)
    return not in_first_year or add_months(contract_start, FIRST_YEAR_MIN_MONTHS) <= on


def status_for(outcome: MigrationOutcome, coverage: EntryStatus) -> EntryStatus:
    """Where an outcome stands: a false alarm first, then coverage, then the brief's disqualifying rows.

    The contract's own coverage record decides, not `outcome.covered`: the contract is where opt-in and
    validation are recorded."""
    if outcome.disposition is Disposition.NOT_A_FAILURE:
        return EntryStatus.NOT_A_FAILURE
    if coverage is not EntryStatus.SUCCESS:
        return coverage
    if not outcome.classification.qualifying:
        if outcome.classification.category is Category.SHARED_INFRASTRUCTURE:
            return EntryStatus.SHARED_INFRASTRUCTURE
        return EntryStatus.UNABLE_TO_RECOVER
    return EntryStatus.SUCCESS if outcome.success else EntryStatus.FAILURE


def tally(entries: Iterable[LedgerEntry], start: date, end: date) -> Tally:
    """Count the entries detected in ``[start, end)``; the order of the entries never matters."""
    lo, hi = day_start(start), day_start(end)
    t = Tally()
    for e in entries:
        if not lo <= e.detected_at < hi:
            continue
        if e.status in COUNTED:
            t.qualifying += 1
            t.successful += e.status is EntryStatus.SUCCESS
        else:
            t.excluded[e.status] += 1
    return t


def success_rate(successful: int, qualifying: int) -> Decimal | None:
    """The rate floored to 6 places (so a rate below 90% never reads as 0.900000); None without events."""
    if qualifying == 0:
        return None
    scale = 10**RATE_PLACES
    return Decimal(successful * scale // qualifying).scaleb(-RATE_PLACES)


def credit_due(successful: int, qualifying: int) -> bool:
    """Below 90%, exactly: 90% itself earns nothing, and no qualifying failure means no rate at all."""
    return qualifying > 0 and Fraction(successful, qualifying) < TARGET_RATE


def summary(t: Tally) -> str:
    if t.qualifying == 0:
        return "no qualifying failures in the window: no rate, no credit"
    verdict = "below" if credit_due(t.successful, t.qualifying) else "meets"
    rate = Fraction(t.successful, t.qualifying)
    return (
        f"{t.successful}/{t.qualifying} qualifying failures live-migrated ({float(rate):.2%}), {verdict} 90%"
    )


def credit_start(window_start: date, window_end: date, credited_through: date | None) -> date:
    """Where the outcomes a credit decision may count begin: the window's start, or the end of the last
    evaluation that issued a credit when that is later. Trailing windows overlap across evaluations; what
    an earlier credit already measured is never paid again."""
    if credited_through is None:
        return window_start
    return min(max(window_start, credited_through), window_end)


def _unpaid_note(unpaid: Tally, since: date) -> str:
    if unpaid.qualifying == 0:
        return f"; no credit: no qualifying failure since the last credit (period ended {since})"
    rate = Fraction(unpaid.successful, unpaid.qualifying)
    return (
        f"; no credit: since the last credit (period ended {since}) {unpaid.successful}/{unpaid.qualifying} "
        f"({float(rate):.2%}) meets 90%, and the failures it paid for are never paid twice"
    )


def evaluate(ctx: EvaluationContext, entries: Iterable[LedgerEntry]) -> Evaluation:
    """One evaluation: the tally of its window and, when due, the one credit notice of its period.

    The rate shown is the full trailing window's. A credit needs that rate below 90% *and* the outcomes
    not yet measured by a credited evaluation (``[credit_start, end)``) below 90% on their own; the
    notice then names that unpaid period and its counts, so that no two notices cover the same outcome."""
    start, end = window_for(ctx.contract_start, ctx.period_end)
    base = {"trigger": ctx.trigger, "term": ctx.term, "period_start": start, "period_end": end}
    if ctx.trigger is Trigger.EXPANSION and not expansion_measured_enough(ctx.contract_start, end):
        note = f"not evaluated: first-year expansion measured under {FIRST_YEAR_MIN_MONTHS} months"
        return Evaluation(**base, evaluated=False, fee=ctx.fee, note=note)
    entries = list(entries)  # tallied twice
    t = tally(entries, start, end)
    since = credit_start(start, end, ctx.credited_through)
    unpaid = t if since == start else tally(entries, since, end)
    rate = success_rate(t.successful, t.qualifying)
    counts = {
        "qualifying": t.qualifying,
        "successful": t.successful,
        "excluded": sum(t.excluded.values()),
        "credit_period_start": since,
        "credit_qualifying": unpaid.qualifying,
        "credit_successful": unpaid.successful,
    }
    note = summary(t)
    credit = None
    if credit_due(t.successful, t.qualifying):
        if ctx.credit_already_this_term:
            note += "; credit already issued for this contract year"
        elif not credit_due(unpaid.successful, unpaid.qualifying):
            note += _unpaid_note(unpaid, since)
        else:
            unpaid_rate = success_rate(unpaid.successful, unpaid.qualifying)
            assert unpaid_rate is not None  # credit_due implies qualifying > 0
            credit = CreditNotice(
                idempotency_key=credit_idempotency_key(ctx.contract_id, end),
                contract_id=ctx.contract_id,
                customer_id=ctx.customer_id,
                period_start=since,
                period_end=end,
                trigger=ctx.trigger.value,
                success_rate=unpaid_rate,
                qualifying=unpaid.qualifying,
                successful=unpaid.successful,
                amount=ctx.fee.times(CREDIT_SHARE),
                apply_to=ctx.apply_to,
                issued_at=ctx.now,
            )
    return Evaluation(
        **base, **counts, evaluated=True, success_rate=rate, fee=ctx.fee, credit=credit, note=note
    )


def prune_horizon(term_start: date, last_evaluated: date | None, today: date) -> date:
    """Entries detected before this day can fall in no future window.

    A future evaluation ends no earlier than the current term's start, the last evaluation, and today
    less the expansion back-dating limit; its window reaches 12 months before that."""
    earliest_end = max(term_start, last_evaluated or term_start, today - EXPANSION_BACKDATE_LIMIT)
    return add_months(earliest_end, -WINDOW_MONTHS)


def check_fee(current: Money, new: Money) -> None:
    if new.currency != current.currency:
        raise ContractRuleError(
            ContractErrorType.CURRENCY_MISMATCH, f"fee in {new.currency}, contract in {current.currency}"
        )
    if new.amount <= 0:
        raise ContractRuleError(ContractErrorType.INVALID_FEE, f"annual fee must be positive, got {new}")


def check_expansion_date(on: date, earliest: date, today: date) -> None:
    """An expansion is dated between the last closed evaluation (or term start) and today."""
    lowest = max(earliest, today - EXPANSION_BACKDATE_LIMIT)
    if not lowest <= on <= today:
        raise ContractRuleError(
            ContractErrorType.DATES_OUT_OF_ORDER, f"expansion date {on} must be within [{lowest}, {today}]"
        )


class ContractBook:
    """A contract's running state and the rules applied to it; `check_*` only read, the rest change it.

    ContractWorkflow calls `check_*` from its update validators (a refusal is a typed error to the caller
    and leaves no trace in history) and the matching method from the handler."""

    def __init__(self, terms: ContractTerms, state: ContractState | None = None) -> None:
        s = state or ContractState(
            term_start=terms.start, renewal_date=terms.renewal_date, annual_fee=terms.annual_fee
        )
        self.terms = terms
        self.term, self.term_start, self.renewal_date = s.term, s.term_start, s.renewal_date
        self.fee, self.renewal, self.awaiting_renewal = s.annual_fee, s.renewal, s.awaiting_renewal
        self.jobs = {j.job_id: j for j in s.jobs}
        self.entries = {e.incident_id: e for e in s.ledger}  # insertion order is recording order
        self.evaluations = list(s.evaluations)
        self.pending = list(s.pending_credits)
        self.deliveries = list(s.deliveries)
        self.credit_retry_at = s.credit_retry_at  # set by ContractWorkflow when billing did not take one
        self.duplicates, self.rejected_signals, self.pruned = s.duplicates, s.rejected_signals, s.pruned
        self.runs, self.rules_version = s.runs, s.rules_version
        self.lapsed = False

    def to_state(self) -> ContractState:
        return ContractState(
            term=self.term,
            term_start=self.term_start,
            renewal_date=self.renewal_date,
            annual_fee=self.fee,
            renewal=self.renewal,
            awaiting_renewal=self.awaiting_renewal,
            jobs=tuple(self.jobs.values()),
            ledger=tuple(self.entries.values()),
            evaluations=tuple(self.evaluations),
            pending_credits=tuple(self.pending),
            deliveries=tuple(self.deliveries),
            credit_retry_at=self.credit_retry_at,
            duplicates=self.duplicates,
            rejected_signals=self.rejected_signals,
            pruned=self.pruned,
            runs=self.runs,
            rules_version=self.rules_version,
        )

    # --- jobs ------------------------------------------------------------------------------------------

    def opt_in(self, job_id: str, now: datetime) -> JobCoverage:
        """Opt a job in from `now`: not covered until a validation passes. Opting in twice is a no-op."""
        job = self.jobs.get(job_id, JobCoverage(job_id=job_id))
        if job.opt_in_mark() is None:
            job = job.with_change(CoverageChange(now, EntryStatus.AWAITING_VALIDATION))
        self.jobs[job_id] = job
        return job

    def check_opted_in(self, job_id: str) -> CoverageChange:
        job = self.jobs.get(job_id)
        mark = job.opt_in_mark() if job else None
        if mark is None:
            raise ContractRuleError(ContractErrorType.UNKNOWN_JOB, f"job {job_id!r} is not opted in")
        return mark

    def opt_out(self, job_id: str, now: datetime) -> JobCoverage:
        self.check_opted_in(job_id)
        job = self.jobs[job_id].with_change(CoverageChange(now, EntryStatus.OPTED_OUT))
        self.jobs[job_id] = job
        return job

    def check_validation(self, report: ValidationReport) -> None:
        if report.contract_id != self.terms.contract_id:
            raise ContractRuleError(
                ContractErrorType.WRONG_CONTRACT,
                f"report for contract {report.contract_id!r}, this is {self.terms.contract_id!r}",
            )
        self.check_opted_in(report.job_id)

    def record_validation(self, report: ValidationReport) -> JobCoverage:
        """A report covers (or uncovers) the job from its time, never before the opt-in it answers."""
        mark = self.check_opted_in(report.job_id)
        status = EntryStatus.SUCCESS if report.passed else EntryStatus.VALIDATION_FAILED
        change = CoverageChange(max(report.validated_at, mark.at), status)
        job = self.jobs[report.job_id].with_change(change)
        self.jobs[report.job_id] = job
        return job

    def covered_jobs(self, now: datetime) -> tuple[str, ...]:
        return tuple(j for j, cov in self.jobs.items() if cov.at(now) is EntryStatus.SUCCESS)

    # --- outcomes --------------------------------------------------------------------------------------

    def last_evaluated(self) -> date | None:
        return max((e.period_end for e in self.evaluations if e.evaluated), default=None)

    def last_credited(self) -> date | None:
        """The end of the last evaluation that issued a credit: outcomes before it were paid for.

        Derived from the evaluations, which travel whole across continue-as-new and are never pruned."""
        return max((e.period_end for e in self.evaluations if e.credit), default=None)

    def credited_this_term(self) -> bool:
        return any(e.credit and e.term == self.term for e in self.evaluations)

    def record_outcome(self, outcome: MigrationOutcome) -> tuple[LedgerEntry, bool]:
        """The ledger entry of an outcome, and whether it was a duplicate (then nothing else changes)."""
        known = self.entries.get(outcome.incident_id)
        if known is not None:
            self.duplicates += 1
            entry = known._replace(duplicates=known.duplicates + 1)
            self.entries[outcome.incident_id] = entry
            return entry, True
        closed = self.last_evaluated()
        status = status_for(outcome, coverage_of(self.jobs.get(outcome.job_id), outcome.detected_at))
        late = closed is not None and outcome.detected_at < day_start(closed)
        recovery = None if outcome.recovery_seconds is None else round(outcome.recovery_seconds, 3)
        entry = LedgerEntry(
            outcome.incident_id, outcome.job_id, outcome.detected_at, status, late, 0, recovery
        )
        self.entries[outcome.incident_id] = entry
        return entry, False

    def prune(self, today: date) -> int:
        """Drop what no future window can count, so the carried ledger stays bounded; returns how many."""
        cutoff = day_start(prune_horizon(self.term_start, self.last_evaluated(), today))
        old = [k for k, e in self.entries.items() if e.detected_at < cutoff]
        for k in old:
            del self.entries[k]
        self.pruned += len(old)
        return len(old)

    # --- evaluations -----------------------------------------------------------------------------------

    def _evaluate(self, trigger: Trigger, period_end: date, apply_to: str, now: datetime) -> Evaluation:
        ctx = EvaluationContext(
            customer_id=self.terms.customer_id,
            contract_id=self.terms.contract_id,
            contract_start=self.terms.start,
            term=self.term,
            trigger=trigger,
            period_end=period_end,
            fee=self.fee,  # the fee in force over the period measured, before this event changes it
            apply_to=apply_to,
            credit_already_this_term=self.credited_this_term(),
            now=now,
            credited_through=self.last_credited(),
        )
        ev = evaluate(ctx, self.entries.values())
        self.evaluations.append(ev)
        if ev.credit is not None:
            self.pending.append(ev.credit)
        return ev

    def check_expand(self, inp: ExpandInput, today: date) -> None:
        if self.awaiting_renewal:
            raise ContractRuleError(
                ContractErrorType.AWAITING_RENEWAL,
                f"the term ended {self.renewal_date} without a renewal: renew first (until "
                f"{self.grace_ends()}), then expand",
            )
        check_fee(self.fee, inp.annual_fee)
        earliest = max(self.term_start, self.last_evaluated() or self.term_start)
        check_expansion_date(inp.on, earliest, today)

    def expand(self, inp: ExpandInput, now: datetime) -> Evaluation:
        """Evaluate at the expansion (once per date: a second one that day is not evaluated again)."""
        self.check_expand(inp, now.date())
        if inp.on in {e.period_end for e in self.evaluations}:
            ev = Evaluation(
                trigger=Trigger.EXPANSION,
                term=self.term,
                period_start=window_for(self.terms.start, inp.on)[0],
                period_end=inp.on,
                evaluated=False,
                fee=self.fee,
                note="not evaluated: this date was already evaluated",
            )
            self.evaluations.append(ev)
        else:
            ev = self._evaluate(Trigger.EXPANSION, inp.on, f"expansion on {inp.on}", now)
        self.fee = inp.annual_fee
        return ev

    def check_renew(self, inp: RenewInput, today: date | None = None) -> None:
        """A renewal's fee is checked like an expansion's; its next renewal date must be after the
        coming (or, awaiting renewal, the passed) renewal date and, when given, after `today`."""
        if inp.annual_fee is not None:
            check_fee(self.fee, inp.annual_fee)
        if inp.next_renewal is None:
            return
        if inp.next_renewal <= self.renewal_date:
            raise ContractRuleError(
                ContractErrorType.DATES_OUT_OF_ORDER,
                f"next renewal {inp.next_renewal} must be after the coming one, {self.renewal_date}",
            )
        if today is not None and inp.next_renewal <= today:
            raise ContractRuleError(
                ContractErrorType.DATES_OUT_OF_ORDER,
                f"next renewal {inp.next_renewal} must be after today, {today}",
            )

    def renew(self, inp: RenewInput, today: date | None = None) -> date:
        """Record the renewal due at `renewal_date`; the latest call wins. Returns the next renewal date.

        Awaiting renewal (the term was evaluated unrenewed, the grace has not passed), the renewal is
        late: the next term starts at once, retroactively from the passed renewal date."""
        self.check_renew(inp, today)
        if self.awaiting_renewal:
            self.renewal = inp
            self._start_next_term()
            return self.renewal_date
        self.renewal = inp
        return inp.next_renewal or add_months(self.renewal_date, 12)

    def _start_next_term(self) -> None:
        assert self.renewal is not None
        next_renewal = self.renewal.next_renewal or add_months(self.renewal_date, 12)
        self.fee = self.renewal.annual_fee or self.fee
        self.term, self.term_start, self.renewal_date = self.term + 1, self.renewal_date, next_renewal
        self.renewal, self.awaiting_renewal = None, False

    def close_term(self, now: datetime) -> Evaluation:
        """The renewal date came: evaluate the term, then start the next one, or (not renewed) await a
        late renewal for `terms.renewal_grace_days`, keeping the term, its dates and the ledger."""
        apply_to = f"renewal on {self.renewal_date}" if self.renewal else "next renewal or expansion"
        ev = self._evaluate(Trigger.RENEWAL, self.renewal_date, apply_to, now)
        if self.renewal is None:
            self.awaiting_renewal = True
            return ev
        self._start_next_term()
        return ev

    def grace_ends(self) -> date:
        """The day (00:00 UTC) a contract awaiting renewal lapses: the renewal date plus the grace."""
        return self.renewal_date + timedelta(days=self.terms.renewal_grace_days)

    def lapse_if_unrenewed(self, now: datetime) -> bool:
        """Awaiting renewal and the grace is over: the contract lapses. Returns whether it lapsed."""
        if self.awaiting_renewal and not self.lapsed and now >= day_start(self.grace_ends()):
            self.lapsed = True
        return self.lapsed

    def delivered(self, delivery: CreditDelivery) -> None:
        self.pending = [c for c in self.pending if c.idempotency_key != delivery.idempotency_key]
        self.deliveries.append(delivery)
        if not self.pending:
            self.credit_retry_at = None

    # --- queries ---------------------------------------------------------------------------------------

    def standing(self, now: datetime) -> Standing:
        """The window as if evaluated at the end of today, and the credit it would earn."""
        start, end = window_for(self.terms.start, now.date() + timedelta(days=1))
        t = tally(self.entries.values(), start, end)
        unpaid = tally(self.entries.values(), credit_start(start, end, self.last_credited()), end)
        projected = None
        if (
            credit_due(t.successful, t.qualifying)
            and credit_due(unpaid.successful, unpaid.qualifying)
            and not self.credited_this_term()
        ):
            projected = self.fee.times(CREDIT_SHARE)
        return Standing(
            customer_id=self.terms.customer_id,
            contract_id=self.terms.contract_id,
            term=self.term,
            term_start=self.term_start,
            renewal_date=self.renewal_date,
            annual_fee=self.fee,
            renewed=self.renewal is not None,
            awaiting_renewal=self.awaiting_renewal and not self.lapsed,
            renewal_grace_ends=self.grace_ends() if self.awaiting_renewal else None,
            lapsed=self.lapsed,
            window_start=start,
            window_end=end,
            qualifying=t.qualifying,
            successful=t.successful,
            excluded=dict(t.excluded),
            success_rate=success_rate(t.successful, t.qualifying),
            summary=summary(t),
            projected_credit=projected,
            next_evaluation=None if self.lapsed or self.awaiting_renewal else self.renewal_date,
            covered_jobs=self.covered_jobs(now),
            evaluations=tuple(self.evaluations),
            pending_credits=len(self.pending),
            next_credit_retry=self.credit_retry_at if self.pending else None,
            delivered_credits=tuple(d.idempotency_key for d in self.deliveries),
            duplicates=self.duplicates,
            rejected_signals=self.rejected_signals,
            runs=self.runs,
        )

    def ledger_page(self, inp: LedgerPageInput) -> LedgerPage:
        entries = list(self.entries.values())
        page = entries[inp.offset : inp.offset + inp.limit]
        more = inp.offset + inp.limit < len(entries)
        return LedgerPage(
            rows=tuple(LedgerRow.of(e) for e in page),
            total=len(entries),
            next_offset=inp.offset + inp.limit if more else None,
            pruned=self.pruned,
        )
