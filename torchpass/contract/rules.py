"""The YOCO contract rules, as pure functions: no Temporal, no clock, no I/O.

Success rate = successful qualifying migrations / total qualifying migrations detected in the
trailing 12 months before the evaluation date (never before the contract start). Evaluations happen
at each renewal and at each expansion; an expansion in the first contract year is evaluated only
when at least 3 months were measured. A rate below 90% (compared exactly, as fractions) earns a
credit of 25% of the annual fee, at most once per contract year, and never twice for the same
failures: the outcomes detected since the last evaluation that issued a credit must on their own be
below 90% too (`credit_start`). A development contract evaluates the same way but never issues a
credit notice. The open cases the product brief leaves are decided in docs/contract.md.

`ContractBook` (`torchpass.contract.book`) applies these rules to a contract's running state;
ContractWorkflow holds one and feeds it the time (`workflow.now()`), so that everything here stays
deterministic and unit-testable.
"""

from __future__ import annotations

import calendar
from collections.abc import Iterable
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from fractions import Fraction

from torchpass.contract.credit import CreditNotice, Money, credit_idempotency_key
from torchpass.contract.entries import COUNTED, DayRollup, EntryStatus, LedgerEntry
from torchpass.contract.evaluation import Evaluation, EvaluationContext, Tally, Trigger
from torchpass.contract.terms import ContractPurpose, ContractRuleError
from torchpass.errors import ErrorType
from torchpass.incident.outcome import MigrationOutcome
from torchpass.models import Category, Disposition
from torchpass.validation.report import ReportStatus, ValidationReport

TARGET_RATE = Fraction(9, 10)
CREDIT_SHARE = Decimal("0.25")
WINDOW_MONTHS = 12
FIRST_YEAR_MIN_MONTHS = 3
# Billing may report an expansion some days after it was bought; not further back than this, so that
# the ledger can drop what no future window will count.
EXPANSION_BACKDATE_LIMIT = timedelta(days=31)
RATE_PLACES = 6
NO_DEVELOPMENT_CREDIT = (
    "; no credit: a development contract never issues a credit notice to billing (its validations "
    "may have waived checks; it is not a customer guarantee)"
)


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
    """First-year expansions need 3 months measured (start -> expansion); later ones always
    count."""
    in_first_year = on < add_months(contract_start, 12)
    return not in_first_year or add_months(contract_start, FIRST_YEAR_MIN_MONTHS) <= on


def status_for(outcome: MigrationOutcome, coverage: EntryStatus) -> EntryStatus:
    """Where an outcome stands: a false alarm first, then coverage, then the brief's disqualifying
    rows.

    The contract's own coverage record decides, not `outcome.covered`: the contract is where opt-in
    and validation are recorded."""
    if outcome.disposition is Disposition.NOT_A_FAILURE:
        return EntryStatus.NOT_A_FAILURE
    if coverage is not EntryStatus.SUCCESS:
        return coverage
    if not outcome.classification.qualifying:
        if outcome.classification.category is Category.SHARED_INFRASTRUCTURE:
            return EntryStatus.SHARED_INFRASTRUCTURE
        return EntryStatus.UNABLE_TO_RECOVER
    return EntryStatus.SUCCESS if outcome.success else EntryStatus.FAILURE


def validation_status(report: ValidationReport, purpose: ContractPurpose) -> EntryStatus:
    """What a validation report makes of a job: covered (SUCCESS) when every check passed, or when
    the only checks not passed were waived and the contract is a development one; otherwise not
    covered."""
    if report.status is ReportStatus.PASSED:
        return EntryStatus.SUCCESS
    if report.status is ReportStatus.PASSED_WITH_WAIVERS:
        if purpose is ContractPurpose.DEVELOPMENT:
            return EntryStatus.SUCCESS
        return EntryStatus.VALIDATION_WAIVED
    return EntryStatus.VALIDATION_FAILED


def tally(entries: Iterable[LedgerEntry | DayRollup], start: date, end: date) -> Tally:
    """Count the entries detected in ``[start, end)``, a day's roll-up as its count; the order of
    the entries never matters."""
    lo, hi = day_start(start), day_start(end)
    t = Tally()
    for e in entries:
        at, n = (day_start(e.day), e.entries) if isinstance(e, DayRollup) else (e.detected_at, 1)
        if not lo <= at < hi:
            continue
        if e.status in COUNTED:
            t.qualifying += n
            t.successful += n if e.status is EntryStatus.SUCCESS else 0
        else:
            t.excluded[e.status] += n
    return t


def success_rate(successful: int, qualifying: int) -> Decimal | None:
    """The rate floored to 6 places (so a rate below 90% never reads as 0.900000); None without
    events."""
    if qualifying == 0:
        return None
    scale = 10**RATE_PLACES
    return Decimal(successful * scale // qualifying).scaleb(-RATE_PLACES)


def credit_due(successful: int, qualifying: int) -> bool:
    """Below 90%, exactly: 90% itself earns nothing, and no qualifying failure means no rate at
    all."""
    return qualifying > 0 and Fraction(successful, qualifying) < TARGET_RATE


def summary(t: Tally) -> str:
    if t.qualifying == 0:
        return "no qualifying failures in the window: no rate, no credit"
    verdict = "below" if credit_due(t.successful, t.qualifying) else "meets"
    rate = Fraction(t.successful, t.qualifying)
    return (
        f"{t.successful}/{t.qualifying} qualifying failures live-migrated ({float(rate):.2%}), "
        f"{verdict} 90%"
    )


def credit_start(window_start: date, window_end: date, credited_through: date | None) -> date:
    """Where the outcomes a credit decision may count begin: the window's start, or the end of the
    last evaluation that issued a credit when that is later. Trailing windows overlap across
    evaluations; what an earlier credit already measured is never paid again."""
    if credited_through is None:
        return window_start
    return min(max(window_start, credited_through), window_end)


def _unpaid_note(unpaid: Tally, since: date) -> str:
    if unpaid.qualifying == 0:
        return f"; no credit: no qualifying failure since the last credit (period ended {since})"
    rate = Fraction(unpaid.successful, unpaid.qualifying)
    return (
        f"; no credit: since the last credit (period ended {since}) "
        f"{unpaid.successful}/{unpaid.qualifying} ({float(rate):.2%}) meets 90%, and the failures "
        "it paid for are never paid twice"
    )


def evaluate(ctx: EvaluationContext, entries: Iterable[LedgerEntry | DayRollup]) -> Evaluation:
    """One evaluation: the tally of its window and, when due, the one credit notice of its period.

    The rate shown is the full trailing window's. A credit needs that rate below 90% *and* the
    outcomes not yet measured by a credited evaluation (``[credit_start, end)``) below 90% on their
    own; the notice then names that unpaid period and its counts, so that no two notices cover the
    same outcome."""
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
        if ctx.purpose is ContractPurpose.DEVELOPMENT:
            note += NO_DEVELOPMENT_CREDIT
        elif ctx.credit_already_this_term:
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

    A future evaluation ends no earlier than the current term's start, the last evaluation, and
    today less the expansion back-dating limit; its window reaches 12 months before that."""
    earliest_end = max(term_start, last_evaluated or term_start, today - EXPANSION_BACKDATE_LIMIT)
    return add_months(earliest_end, -WINDOW_MONTHS)


def check_fee(current: Money, new: Money) -> None:
    if new.currency != current.currency:
        raise ContractRuleError(
            ErrorType.CONTRACT_CURRENCY_MISMATCH,
            f"fee in {new.currency}, contract in {current.currency}",
        )
    if new.amount <= 0:
        raise ContractRuleError(
            ErrorType.CONTRACT_INVALID_FEE, f"annual fee must be positive, got {new}"
        )


def check_expansion_date(on: date, earliest: date, today: date) -> None:
    """An expansion is dated between the last closed evaluation (or term start) and today."""
    lowest = max(earliest, today - EXPANSION_BACKDATE_LIMIT)
    if not lowest <= on <= today:
        raise ContractRuleError(
            ErrorType.CONTRACT_DATES_OUT_OF_ORDER,
            f"expansion date {on} must be within [{lowest}, {today}]",
        )
