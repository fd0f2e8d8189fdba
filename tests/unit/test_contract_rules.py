"""The YOCO contract rules (torchpass.contract.rules), without Temporal: the brief's rules and the
decided cases."""

from __future__ import annotations

import random
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from torchpass.contract import ledger
from torchpass.contract.book import ContractBook
from torchpass.contract.credit import Money, credit_idempotency_key
from torchpass.contract.entries import EXCLUSION_REASON, EntryStatus, LedgerEntry
from torchpass.contract.evaluation import Trigger
from torchpass.contract.queries import LedgerPageInput
from torchpass.contract.rules import (
    add_months,
    credit_due,
    day_start,
    expansion_measured_enough,
    status_for,
    success_rate,
    tally,
    window_for,
)
from torchpass.contract.state import ContractInput, ContractState
from torchpass.contract.terms import (
    DEVELOPMENT_BANNER,
    ContractPurpose,
    ContractRuleError,
    ContractTerms,
    ExpandInput,
    RenewInput,
)
from torchpass.errors import ErrorType
from torchpass.incident.outcome import MigrationOutcome
from torchpass.models import Category, Classification, Disposition, FailureKind
from torchpass.render import format_ledger, format_standing
from torchpass.validation.checks import build_report
from torchpass.validation.report import CheckResult, CheckStatus, ReportStatus, ValidationReport

START = date(2026, 1, 15)
T0 = day_start(START) + timedelta(hours=1)
FEE = Money(amount=Decimal("120000.00"), currency="USD")
QUALIFYING = Classification(category=Category.INTERRUPTION, qualifying=True, reason="process exit")


def usd(amount: str) -> Money:
    return Money(amount=Decimal(amount), currency="USD")


def terms(**kw: object) -> ContractTerms:
    base: dict[str, object] = {
        "customer_id": "acme",
        "contract_id": "c-1",
        "start": START,
        "renewal_date": add_months(START, 12),
        "annual_fee": FEE,
    }
    return ContractTerms.model_validate(base | kw)


def outcome(
    n: int, at: datetime, *, success: bool = True, job: str = "job-a", **kw: object
) -> MigrationOutcome:
    base: dict[str, object] = {
        "incident_id": f"inc-{n}",
        "job_id": job,
        "failure_domain": "node-1",
        "kind": FailureKind.PROCESS_EXIT,
        "evidence_count": 1,
        "classification": QUALIFYING,
        "covered": True,
        "disposition": Disposition.MIGRATED if success else Disposition.FALLBACK_RESTART,
        "success": success,
        "detected_at": at,
    }
    return MigrationOutcome.model_validate(base | kw)


def report(passed: bool, at: datetime, job: str = "job-a") -> ValidationReport:
    check = CheckResult(name="agent_present", passed=passed)
    return ValidationReport(
        contract_id="c-1", job_id=job, passed=passed, checks=(check,), validated_at=at
    )


def waived_report(at: datetime, job: str = "job-a") -> ValidationReport:
    """Every check passed but the scheduler, waived by the local-development override."""
    checks = [
        CheckResult(name="agent_present", passed=True),
        CheckResult(name="scheduler", status=CheckStatus.WAIVED, detail="WAIVED: allow_local"),
    ]
    return build_report("c-1", job, checks, at)


def covered_book(*jobs: str) -> ContractBook:
    book = ContractBook(terms())
    for job in jobs or ("job-a",):
        book.jobs.opt_in(job, T0)
        book.jobs.record_validation(report(True, T0, job))
    return book


def fill(book: ContractBook, first: int, month: int, successes: int, failures: int) -> None:
    """Outcomes detected during month `month` of the contract (0-based)."""
    at = day_start(add_months(START, month)) + timedelta(days=1)
    for i in range(successes + failures):
        book.record_outcome(outcome(first + i, at + timedelta(minutes=i), success=i < successes))


# --- dates and windows
# ---------------------------------------------------------------------------------


def test_months_are_calendar_months_clamped_to_the_month_end() -> None:
    assert add_months(date(2026, 1, 31), 1) == date(2026, 2, 28)
    assert add_months(date(2028, 2, 29), -12) == date(2027, 2, 28)
    assert add_months(date(2026, 11, 15), 3) == date(2027, 2, 15)


def test_the_window_is_the_trailing_12_months_never_before_the_start() -> None:
    assert window_for(START, add_months(START, 5)) == (START, add_months(START, 5))
    assert window_for(START, add_months(START, 20)) == (add_months(START, 8), add_months(START, 20))


def test_a_first_year_expansion_needs_three_months_measured() -> None:
    assert not expansion_measured_enough(START, add_months(START, 2))
    assert not expansion_measured_enough(START, add_months(START, 3) - timedelta(days=1))
    assert expansion_measured_enough(START, add_months(START, 3))
    assert expansion_measured_enough(START, add_months(START, 12) + timedelta(days=10))


# --- the rate and the credit
# ---------------------------------------------------------------------------


def test_exactly_ninety_percent_earns_no_credit_and_just_below_does() -> None:
    assert not credit_due(9, 10) and not credit_due(900, 1000)
    assert credit_due(899, 1000) and credit_due(8999999, 10**7)
    assert success_rate(8999999, 10**7) == Decimal("0.899999")  # floored, never shown as 0.9


def test_no_qualifying_failure_means_no_rate_and_no_credit() -> None:
    book = covered_book()
    ev = book.close_term(day_start(book.term.renewal_date))
    assert ev.evaluated and ev.qualifying == 0 and ev.success_rate is None and ev.credit is None
    assert "no qualifying failures" in ev.note
    assert "no qualifying failures" in book.standing(T0).summary


def test_a_renewal_below_ninety_percent_issues_one_credit_of_a_quarter_of_the_fee() -> None:
    book = covered_book()
    fill(book, 0, 1, successes=8, failures=2)  # 80%
    book.term.renew(RenewInput())
    renewal = book.term.renewal_date
    now = day_start(renewal) + timedelta(seconds=5)
    ev = book.close_term(now)
    assert ev.trigger is Trigger.RENEWAL and ev.credit is not None
    c = ev.credit
    assert c.idempotency_key == credit_idempotency_key("c-1", renewal)
    assert (c.period_start, c.period_end, c.trigger) == (START, renewal, "renewal")
    assert (c.qualifying, c.successful, c.success_rate) == (10, 8, Decimal("0.8"))
    assert c.amount == usd("30000.00") and c.customer_id == "acme" and c.issued_at == now
    assert c.apply_to == f"renewal on {renewal}"
    assert book.evaluations.pending_credits == [c]
    assert book.term.number == 1 and book.term.renewal_date == add_months(renewal, 12)


def test_excluded_events_stay_in_the_ledger_with_their_reason_but_not_in_the_rate() -> None:
    book = covered_book()
    at = T0 + timedelta(days=3)
    shared = Classification(
        category=Category.SHARED_INFRASTRUCTURE, qualifying=False, reason="fabric"
    )
    no_spare = Classification(
        category=Category.UNABLE_TO_RECOVER, qualifying=False, reason="no spare"
    )
    book.record_outcome(outcome(1, at, success=False, classification=shared))
    book.record_outcome(outcome(2, at, success=False, classification=no_spare))
    book.record_outcome(outcome(3, at, success=False, disposition=Disposition.NOT_A_FAILURE))
    book.record_outcome(outcome(4, at, success=False, job="job-unknown"))
    book.record_outcome(outcome(5, at, success=True))
    s = book.standing(at)
    assert (s.qualifying, s.successful, s.success_rate) == (1, 1, Decimal(1))
    rows = {r.incident_id: r for r in book.ledger_page(LedgerPageInput()).rows}
    assert rows["inc-1"].status is EntryStatus.SHARED_INFRASTRUCTURE and not rows["inc-1"].counted
    assert rows["inc-2"].status is EntryStatus.UNABLE_TO_RECOVER
    assert rows["inc-3"].status is EntryStatus.NOT_A_FAILURE
    assert rows["inc-4"].reason is not None and "not opted in" in rows["inc-4"].reason
    assert rows["inc-5"].counted and rows["inc-5"].reason is None


# --- coverage: opt-in, validation, opt-out
# -------------------------------------------------------------


def test_a_job_is_covered_only_between_a_passed_validation_and_an_opt_out() -> None:
    book = ContractBook(terms())
    book.jobs.opt_in("job-a", T0)
    before = outcome(1, T0 + timedelta(hours=1), success=False)
    book.jobs.record_validation(report(True, T0 + timedelta(hours=2)))
    during = outcome(2, T0 + timedelta(hours=3), success=False)
    book.jobs.opt_out("job-a", T0 + timedelta(hours=4))
    after = outcome(3, T0 + timedelta(hours=5), success=False)
    statuses = [book.record_outcome(o)[0].status for o in (before, during, after)]
    assert statuses == [EntryStatus.AWAITING_VALIDATION, EntryStatus.FAILURE, EntryStatus.OPTED_OUT]


def test_a_failed_validation_leaves_the_job_uncovered() -> None:
    book = ContractBook(terms())
    book.jobs.opt_in("job-a", T0)
    book.jobs.record_validation(report(False, T0 + timedelta(minutes=1)))
    entry, _ = book.record_outcome(outcome(1, T0 + timedelta(hours=1), success=False))
    assert entry.status is EntryStatus.VALIDATION_FAILED
    assert book.jobs.covered(T0 + timedelta(hours=1)) == ()


def test_opting_in_again_needs_a_new_validation() -> None:
    book = covered_book()
    book.jobs.opt_out("job-a", T0 + timedelta(hours=1))
    book.jobs.opt_in("job-a", T0 + timedelta(hours=2))
    entry, _ = book.record_outcome(outcome(1, T0 + timedelta(hours=3)))
    assert entry.status is EntryStatus.AWAITING_VALIDATION


def test_a_report_dated_before_its_opt_in_covers_from_the_opt_in() -> None:
    book = ContractBook(terms())
    book.jobs.opt_in("job-a", T0)
    book.jobs.record_validation(report(True, T0 - timedelta(days=1)))
    assert book.jobs.coverage["job-a"].at(T0 - timedelta(hours=1)) is EntryStatus.NOT_OPTED_IN
    assert book.jobs.coverage["job-a"].at(T0) is EntryStatus.SUCCESS


def test_validation_of_an_unknown_job_or_another_contract_is_refused() -> None:
    book = ContractBook(terms())
    with pytest.raises(ContractRuleError) as e:
        book.jobs.check_validation(report(True, T0, job="job-x"))
    assert e.value.error_type is ErrorType.CONTRACT_UNKNOWN_JOB
    book.jobs.opt_in("job-x", T0)
    other = report(True, T0, job="job-x").model_copy(update={"contract_id": "c-2"})
    with pytest.raises(ContractRuleError) as e:
        book.jobs.check_validation(other)
    assert e.value.error_type is ErrorType.CONTRACT_WRONG_CONTRACT
    with pytest.raises(ContractRuleError):
        ContractBook(terms()).jobs.opt_out("job-never", T0)


# --- waived checks, customer and development contracts
# -------------------------------------------------


def test_a_waived_check_does_not_cover_a_job_on_a_customer_contract() -> None:
    book = ContractBook(terms())
    assert book.terms.purpose is ContractPurpose.CUSTOMER  # the default
    book.jobs.opt_in("job-a", T0)
    waived = waived_report(T0 + timedelta(minutes=1))
    assert waived.status is ReportStatus.PASSED_WITH_WAIVERS and waived.waived == ("scheduler",)
    cov = book.jobs.record_validation(waived)
    assert cov.changes[-1].status is EntryStatus.VALIDATION_WAIVED
    at = T0 + timedelta(hours=1)
    entry, _ = book.record_outcome(outcome(1, at, success=False))
    book.record_outcome(outcome(2, at, success=True))
    assert entry.status is EntryStatus.VALIDATION_WAIVED and book.jobs.covered(at) == ()
    s = book.standing(at)
    assert (s.qualifying, s.successful) == (0, 0) and s.excluded == {
        EntryStatus.VALIDATION_WAIVED: 2
    }
    assert s.purpose is ContractPurpose.CUSTOMER and DEVELOPMENT_BANNER not in format_standing(s)
    rows = book.ledger_page(LedgerPageInput()).rows
    reason = EXCLUSION_REASON[EntryStatus.VALIDATION_WAIVED]
    assert all(not r.counted and r.reason == reason for r in rows)
    assert "waived checks" in reason and "not accepted on a customer contract" in reason
    # A clean validation afterwards covers it as usual.
    book.jobs.record_validation(report(True, T0 + timedelta(hours=2)))
    assert book.record_outcome(outcome(3, T0 + timedelta(hours=3)))[0].status is EntryStatus.SUCCESS


def with_failed_check(r: ValidationReport) -> ValidationReport:
    return build_report(
        r.contract_id,
        r.job_id,
        (*r.checks, CheckResult(name="spare_pool", passed=False)),
        r.validated_at,
    )


def dev_book() -> ContractBook:
    book = ContractBook(terms(purpose="development"))
    book.jobs.opt_in("job-a", T0)
    book.jobs.record_validation(waived_report(T0))
    return book


def test_a_waived_check_covers_a_job_on_a_development_contract_and_its_outcomes_count() -> None:
    book = dev_book()
    assert book.terms.purpose is ContractPurpose.DEVELOPMENT
    at = T0 + timedelta(hours=1)
    assert book.jobs.covered(at) == ("job-a",)
    statuses = [book.record_outcome(outcome(n, at, success=n > 0))[0].status for n in range(2)]
    assert statuses == [EntryStatus.FAILURE, EntryStatus.SUCCESS]
    s = book.standing(at)
    assert (s.qualifying, s.successful, s.purpose) == (2, 1, ContractPurpose.DEVELOPMENT)
    # It says so, loudly: the standing and the ledger open with the banner.
    assert format_standing(s).splitlines()[0] == DEVELOPMENT_BANNER
    page = book.ledger_page(LedgerPageInput())
    assert page.purpose is ContractPurpose.DEVELOPMENT
    assert format_ledger(page).splitlines()[0] == DEVELOPMENT_BANNER
    # A failed check still fails on a development contract.
    failed = with_failed_check(waived_report(T0 + timedelta(hours=2)))
    assert book.jobs.record_validation(failed).changes[-1].status is EntryStatus.VALIDATION_FAILED


def test_a_development_contract_never_issues_a_credit() -> None:
    book = dev_book()
    fill(book, 0, 1, successes=8, failures=2)  # 80%: a customer contract earns 30,000
    fill(book, 10, 4, successes=1, failures=4)
    assert book.standing(T0 + timedelta(days=200)).projected_credit is None
    exp = book.expand(
        ExpandInput(on=add_months(START, 5), annual_fee=FEE), day_start(add_months(START, 5))
    )
    assert exp.evaluated and (exp.qualifying, exp.successful) == (15, 9) and exp.credit is None
    assert "development contract never issues a credit notice" in exp.note
    book.term.renew(RenewInput())
    ev = book.close_term(day_start(book.term.renewal_date))
    assert ev.evaluated and (ev.qualifying, ev.successful) == (15, 9) and ev.credit is None
    assert "below 90%" in ev.note and "development contract never issues a credit notice" in ev.note
    assert book.evaluations.pending_credits == [] and book.evaluations.last_credited() is None
    # The same outcomes on a customer contract earn the year's credit.
    customer = covered_book()
    fill(customer, 0, 1, successes=8, failures=2)
    assert customer.close_term(day_start(customer.term.renewal_date)).credit is not None


def test_old_terms_without_a_purpose_are_a_customer_contract() -> None:
    raw = terms().model_dump(mode="json")
    del raw["purpose"]
    assert ContractTerms.model_validate(raw).purpose is ContractPurpose.CUSTOMER
    with pytest.raises(ValidationError):
        terms(purpose="demo")


# --- duplicates and late outcomes
# ----------------------------------------------------------------------


def test_a_duplicate_incident_is_recorded_as_such_and_counted_once() -> None:
    book = covered_book()
    o = outcome(1, T0 + timedelta(days=1), success=False)
    _, dup1 = book.record_outcome(o)
    entry, dup2 = book.record_outcome(o.model_copy(update={"success": True}))  # first record wins
    assert (dup1, dup2) == (False, True) and entry.duplicates == 1 and book.duplicates == 1
    s = book.standing(T0 + timedelta(days=2))
    assert (s.qualifying, s.successful, s.duplicates) == (1, 0, 1)


def test_a_late_outcome_never_reopens_an_evaluation_but_counts_in_later_windows() -> None:
    book = covered_book()
    fill(book, 0, 1, successes=10, failures=0)
    month5 = add_months(START, 5)
    ev = book.expand(ExpandInput(on=month5, annual_fee=usd("150000")), day_start(month5))
    assert ev.evaluated and ev.qualifying == 10 and ev.credit is None
    late_at = day_start(add_months(START, 2))
    entry, _ = book.record_outcome(outcome(99, late_at, success=False))
    assert entry.late
    assert book.evaluations.closed[0] == ev  # closed: unchanged
    renewal = book.close_term(day_start(book.term.renewal_date))
    assert (renewal.qualifying, renewal.successful) == (11, 10)
    on_time, _ = book.record_outcome(
        outcome(100, day_start(book.term.renewal_date) + timedelta(days=1))
    )
    assert not on_time.late


# --- expansions
# ----------------------------------------------------------------------------------------


def test_an_expansion_in_month_two_is_recorded_but_not_evaluated() -> None:
    book = covered_book()
    fill(book, 0, 0, successes=0, failures=5)  # 0%: would earn a credit if evaluated
    month2 = add_months(START, 2)
    ev = book.expand(ExpandInput(on=month2, annual_fee=usd("130000")), day_start(month2))
    assert not ev.evaluated and ev.credit is None and "under 3 months" in ev.note
    assert book.term.fee == usd("130000") and not book.evaluations.pending_credits


def test_at_most_one_credit_per_contract_year_across_expansions_and_renewal() -> None:
    book = covered_book()
    fill(book, 0, 1, successes=1, failures=9)
    first = book.expand(
        ExpandInput(on=add_months(START, 4), annual_fee=usd("150000")),
        day_start(add_months(START, 4)),
    )
    second = book.expand(
        ExpandInput(on=add_months(START, 6), annual_fee=usd("200000")),
        day_start(add_months(START, 6)),
    )
    book.term.renew(RenewInput())
    renewal = book.close_term(day_start(book.term.renewal_date))
    assert first.credit is not None and second.credit is None and renewal.credit is None
    assert "already issued" in second.note and "already issued" in renewal.note
    fill(book, 100, 13, successes=0, failures=3)  # the next contract year earns its own credit
    nxt = book.expand(
        ExpandInput(on=add_months(START, 15), annual_fee=usd("200000")),
        day_start(add_months(START, 15)),
    )
    assert nxt.credit is not None and nxt.term == 1


def _credited_year_zero() -> ContractBook:
    """The reviewer's contract: 100,000 a year; the year ends at 80/100, 3 of the failures in its
    first days, so that a window 9 days later measures 80/97 without one new failure."""
    book = ContractBook(terms(annual_fee=usd("100000.00")))
    book.jobs.opt_in("job-a", T0)
    book.jobs.record_validation(report(True, T0))
    fill(book, 0, 0, successes=0, failures=3)  # day 1 of the contract
    fill(book, 3, 5, successes=80, failures=17)
    book.term.renew(RenewInput())
    ev = book.close_term(day_start(book.term.renewal_date))
    assert (ev.qualifying, ev.successful) == (100, 80)
    assert ev.credit is not None and ev.credit.amount == usd("25000.00") and ev.term == 0
    return book


def test_a_shortfall_already_credited_is_not_credited_again_in_the_next_year() -> None:
    book = _credited_year_zero()
    renewal = book.term.start
    on = renewal + timedelta(days=9)
    assert book.standing(day_start(on) - timedelta(hours=1)).projected_credit is None
    ev = book.expand(ExpandInput(on=on, annual_fee=usd("110000.00")), day_start(on))
    # The trailing window still shows the shortfall: 80/97. But every one of its failures was
    # measured by the renewal that paid for it; nothing since then can earn a credit.
    assert ev.evaluated and ev.term == 1 and (ev.qualifying, ev.successful) == (97, 80)
    assert ev.credit_period_start == renewal and (ev.credit_qualifying, ev.credit_successful) == (
        0,
        0,
    )
    assert ev.credit is None and "no qualifying failure since the last credit" in ev.note
    pending = book.evaluations.pending_credits
    assert len(pending) == 1 and pending[0].period_end == renewal  # only the renewal's credit


def test_new_failures_after_the_credited_period_earn_the_next_years_credit() -> None:
    book = _credited_year_zero()
    renewal = book.term.start
    fill(book, 200, 13, successes=2, failures=3)  # a month into year 1
    month15 = add_months(START, 15)
    assert book.standing(day_start(month15) - timedelta(hours=1)).projected_credit == usd(
        "25000.00"
    )
    ev = book.expand(ExpandInput(on=month15, annual_fee=usd("110000.00")), day_start(month15))
    assert (ev.qualifying, ev.successful) == (102, 82)  # the trailing window, as shown
    assert ev.credit is not None and ev.term == 1 and ev.credit.amount == usd("25000.00")
    # The notice names only what it pays for: the outcomes since the renewal's credit.
    c = ev.credit
    assert (c.period_start, c.period_end) == (renewal, month15)
    assert (c.qualifying, c.successful, c.success_rate) == (5, 2, Decimal("0.4"))
    pending = book.evaluations.pending_credits
    assert c.idempotency_key != pending[0].idempotency_key and len(pending) == 2


def test_outcomes_since_the_last_credit_must_be_below_ninety_on_their_own() -> None:
    book = _credited_year_zero()
    fill(book, 200, 13, successes=10, failures=0)
    month15 = add_months(START, 15)
    ev = book.expand(ExpandInput(on=month15, annual_fee=usd("110000.00")), day_start(month15))
    # 84%: below, but all its failures were paid for
    assert (ev.qualifying, ev.successful) == (107, 90)
    assert (ev.credit_qualifying, ev.credit_successful) == (10, 10)
    assert ev.credit is None and "meets 90%" in ev.note


def test_the_trailing_year_must_still_be_below_ninety_for_a_credit() -> None:
    book = covered_book()
    fill(book, 0, 1, successes=0, failures=15)
    fill(book, 100, 11, successes=85, failures=0)
    book.term.renew(RenewInput())
    assert book.close_term(day_start(book.term.renewal_date)).credit is not None  # 85/100
    fill(book, 200, 13, successes=0, failures=1)  # since the credit: 0/1
    month14 = add_months(START, 14)
    ev = book.expand(ExpandInput(on=month14, annual_fee=usd("150000")), day_start(month14))
    # the brief's measure: 98.8%
    assert (ev.qualifying, ev.successful) == (86, 85) and ev.credit is None


def test_the_credit_uses_the_fee_in_force_over_the_measured_period() -> None:
    book = covered_book()
    fill(book, 0, 1, successes=0, failures=4)
    month4 = add_months(START, 4)
    ev = book.expand(ExpandInput(on=month4, annual_fee=usd("200000")), day_start(month4))
    assert ev.credit is not None and ev.fee == FEE and ev.credit.amount == usd("30000.00")
    assert ev.credit.apply_to == f"expansion on {month4}"
    assert book.term.fee == usd("200000")


def test_a_second_expansion_on_an_evaluated_date_is_not_evaluated_again() -> None:
    book = covered_book()
    month4 = add_months(START, 4)
    book.expand(ExpandInput(on=month4, annual_fee=usd("150000")), day_start(month4))
    again = book.expand(ExpandInput(on=month4, annual_fee=usd("160000")), day_start(month4))
    assert (
        not again.evaluated and "already evaluated" in again.note and book.term.fee == usd("160000")
    )


# --- bad input
# -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fee", "on_month", "today_month", "kind"),
    [
        ("-1", 4, 4, ErrorType.CONTRACT_INVALID_FEE),
        ("0", 4, 4, ErrorType.CONTRACT_INVALID_FEE),
        ("100", 5, 4, ErrorType.CONTRACT_DATES_OUT_OF_ORDER),  # in the future
        ("100", 1, 4, ErrorType.CONTRACT_DATES_OUT_OF_ORDER),  # back-dated over a month
    ],
)
def test_a_bad_expansion_is_refused_with_its_rule(
    fee: str, on_month: int, today_month: int, kind: str
) -> None:
    book = covered_book()
    with pytest.raises(ContractRuleError) as e:
        book.check_expand(
            ExpandInput(on=add_months(START, on_month), annual_fee=usd(fee)),
            add_months(START, today_month),
        )
    assert e.value.error_type == kind


def test_an_expansion_before_a_closed_evaluation_or_in_another_currency_is_refused() -> None:
    book = covered_book()
    month5 = add_months(START, 5)
    book.expand(ExpandInput(on=month5, annual_fee=usd("150000")), day_start(month5))
    with pytest.raises(ContractRuleError) as e:
        book.check_expand(ExpandInput(on=month5 - timedelta(days=1), annual_fee=usd("1")), month5)
    assert e.value.error_type is ErrorType.CONTRACT_DATES_OUT_OF_ORDER
    eur = Money(amount=Decimal("1"), currency="EUR")
    with pytest.raises(ContractRuleError) as e:
        book.check_expand(ExpandInput(on=month5, annual_fee=eur), month5)
    assert e.value.error_type is ErrorType.CONTRACT_CURRENCY_MISMATCH


def test_a_renewal_cannot_move_the_next_renewal_backwards() -> None:
    book = covered_book()
    with pytest.raises(ContractRuleError) as e:
        book.term.renew(RenewInput(next_renewal=book.term.renewal_date))
    assert e.value.error_type is ErrorType.CONTRACT_DATES_OUT_OF_ORDER
    assert book.term.renewal is None


@pytest.mark.parametrize(
    "bad",
    [
        {"annual_fee": {"amount": "-5", "currency": "USD"}},
        {"renewal_date": START},
        {"contract_id": ""},
    ],
)
def test_terms_with_a_negative_fee_or_dates_out_of_order_do_not_validate(
    bad: dict[str, object],
) -> None:
    with pytest.raises(ValidationError):
        terms(**bad)


def test_a_contract_that_is_not_renewed_is_evaluated_and_lapses_after_the_grace() -> None:
    book = covered_book()
    fill(book, 0, 1, successes=0, failures=1)
    renewal = book.term.renewal_date
    ev = book.close_term(day_start(renewal))
    # Evaluated exactly as before; the credit applies to whatever the customer buys next.
    assert ev.credit is not None and ev.credit.apply_to == "next renewal or expansion"
    term = book.term
    assert (
        not term.lapsed
        and term.awaiting_renewal
        and term.number == 0
        and term.renewal_date == renewal
    )
    grace_ends = renewal + timedelta(days=60)
    s = book.standing(day_start(renewal) + timedelta(days=1))
    assert s.awaiting_renewal and s.renewal_grace_ends == grace_ends and s.next_evaluation is None
    assert not s.lapsed and not s.renewed
    assert not book.term.lapse_if_unrenewed(day_start(grace_ends) - timedelta(seconds=1))
    assert book.term.lapse_if_unrenewed(day_start(grace_ends))
    s = book.standing(day_start(grace_ends))
    assert s.lapsed and not s.awaiting_renewal and s.next_evaluation is None
    assert len(book.evaluations.pending_credits) == 1  # the credit is still owed


def test_no_grace_lapses_at_the_renewal() -> None:
    book = ContractBook(terms(renewal_grace_days=0))
    book.close_term(day_start(book.term.renewal_date) + timedelta(minutes=20))
    assert book.term.lapse_if_unrenewed(day_start(book.term.renewal_date) + timedelta(minutes=20))


@pytest.mark.parametrize("days", [-1, 367])
def test_the_grace_is_validated(days: int) -> None:
    with pytest.raises(ValidationError):
        terms(renewal_grace_days=days)


def test_a_late_renewal_starts_the_next_term_from_the_renewal_date() -> None:
    book = covered_book()
    fill(book, 0, 1, successes=0, failures=1)
    renewal = book.term.renewal_date
    book.close_term(day_start(renewal))
    # Outcomes and opt-ins are still recorded while the contract awaits its renewal.
    late = day_start(renewal) + timedelta(days=3)
    entry, _ = book.record_outcome(outcome(50, late, success=False))
    assert entry.status is EntryStatus.FAILURE and not entry.late
    book.jobs.opt_in("job-b", late)
    assert "job-b" in book.jobs.coverage
    # An expansion must wait for the renewal: which contract year it would be in is not known yet.
    with pytest.raises(ContractRuleError) as e:
        book.check_expand(ExpandInput(on=late.date(), annual_fee=usd("150000")), late.date())
    assert e.value.error_type is ErrorType.CONTRACT_AWAITING_RENEWAL
    today = renewal + timedelta(days=10)
    with pytest.raises(ContractRuleError) as e:  # a next renewal already passed is refused
        book.term.check_renew(RenewInput(next_renewal=today), today)
    assert e.value.error_type is ErrorType.CONTRACT_DATES_OUT_OF_ORDER
    term = book.term
    assert term.renew(RenewInput(annual_fee=usd("150000")), today) == add_months(renewal, 12)
    assert not term.awaiting_renewal and term.renewal is None
    assert (term.number, term.start, term.renewal_date) == (1, renewal, add_months(renewal, 12))
    assert term.fee == usd("150000") and not term.lapse_if_unrenewed(
        day_start(today) + timedelta(days=90)
    )
    s = book.standing(day_start(today))
    assert not s.awaiting_renewal and s.next_evaluation == add_months(renewal, 12)
    # The next renewal counts the days before the late `renew`, in the new term; no credit twice.
    book.term.renew(RenewInput())
    ev = book.close_term(day_start(book.term.renewal_date))
    assert (ev.term, ev.period_start, ev.credit_period_start) == (1, renewal, renewal)
    assert (ev.qualifying, ev.successful) == (1, 0) and ev.credit is not None
    assert ev.fee == usd("150000")


def test_awaiting_renewal_survives_continue_as_new() -> None:
    book = covered_book()
    book.close_term(day_start(book.term.renewal_date))
    again = ContractInput.model_validate_json(
        ContractInput(terms=book.terms, state=book.to_state()).model_dump_json()
    )
    copy = ContractBook(again.terms, again.state)
    assert copy.term.awaiting_renewal and copy.term.grace_ends() == book.term.grace_ends()


def test_the_ledger_keeps_the_recovery_time_to_the_millisecond() -> None:
    book = covered_book()
    e, _ = book.record_outcome(outcome(1, T0, recovery_seconds=41.23456))
    e2, _ = book.record_outcome(outcome(2, T0, success=False))
    assert e.recovery_seconds == 41.235 and e2.recovery_seconds is None
    rows = book.ledger_page(LedgerPageInput()).rows
    assert [r.recovery_seconds for r in rows] == [41.235, None]
    # A state carried before the field existed (6-element entries) still loads.
    old = ContractState.model_validate(
        {**book.to_state().model_dump(mode="json"), "ledger": [list(e)[:6]]}
    )
    assert old.ledger[0].recovery_seconds is None


# --- state: continue-as-new and pruning
# ----------------------------------------------------------------


def test_state_round_trips_through_json_and_keeps_the_standing() -> None:
    book = covered_book("job-a", "job-b")
    fill(book, 0, 1, successes=7, failures=3)
    book.record_outcome(outcome(0, T0))
    book.expand(
        ExpandInput(on=add_months(START, 4), annual_fee=usd("150000")),
        day_start(add_months(START, 4)),
    )
    inp = ContractInput(terms=book.terms, state=book.to_state())
    again = ContractInput.model_validate_json(inp.model_dump_json())
    copy = ContractBook(again.terms, again.state)
    now = T0 + timedelta(days=200)
    assert copy.standing(now) == book.standing(now) and copy.to_state() == book.to_state()


def test_a_pending_credit_and_its_retry_time_survive_continue_as_new() -> None:
    book = covered_book()
    fill(book, 0, 1, successes=0, failures=2)
    book.term.renew(RenewInput())
    book.close_term(day_start(book.term.renewal_date))
    retry = day_start(book.term.start) + timedelta(hours=7)
    book.evaluations.credit_retry_at = retry
    again = ContractInput.model_validate_json(
        ContractInput(terms=book.terms, state=book.to_state()).model_dump_json()
    )
    copy = ContractBook(again.terms, again.state)
    assert copy.evaluations.credit_retry_at == retry
    assert copy.evaluations.pending_credits == book.evaluations.pending_credits
    assert copy.standing(retry).next_credit_retry == retry
    assert copy.evaluations.last_credited() == book.term.start  # what was paid for stays paid for


def test_a_year_of_ten_thousand_outcomes_fits_one_payload() -> None:
    # 13 months at 10,000 a year (what pruning may keep) with ids as long as MigrationWorkflow's.
    incident = "torchpass-incident-job-000000-node-000017-g12/0f8e0c1a-1234-4567-89ab-0123456789ab"
    entries = tuple(
        LedgerEntry(
            f"{incident}-{i}",
            f"job-{i % 64}",
            T0 + timedelta(minutes=47 * i),
            EntryStatus.SUCCESS,
            recovery_seconds=round(40 + i / 997, 3),  # milliseconds, as recorded
        )
        for i in range(10_900)
    )
    state = ContractState(
        term_start=START, renewal_date=add_months(START, 12), annual_fee=FEE, ledger=entries
    )
    size = len(ContractInput(terms=terms(), state=state).model_dump_json())
    assert size < 1_700_000, size  # Temporal refuses payloads over 2 MiB


def test_pruning_drops_only_what_no_future_window_counts() -> None:
    book = covered_book()
    fill(book, 0, 1, successes=5, failures=0)
    fill(book, 100, 10, successes=5, failures=0)
    book.term.renew(RenewInput())
    book.close_term(day_start(book.term.renewal_date))
    today = add_months(START, 15)
    ends = (today - timedelta(days=31), today, book.term.renewal_date)
    before = [tally(book.entries.values(), *window_for(START, end)) for end in ends]
    dropped = book.prune(today)
    # month 1's outcomes: before any window ending after today-31d
    assert dropped == 5 and book.pruned == 5
    # every window a future evaluation can have still sees what it saw before
    assert [tally(book.entries.values(), *window_for(START, end)) for end in ends] == before
    assert before[0].qualifying == 5


def test_the_ledger_is_paged() -> None:
    book = covered_book()
    fill(book, 0, 1, successes=25, failures=0)
    first = book.ledger_page(LedgerPageInput(offset=0, limit=10))
    last = book.ledger_page(LedgerPageInput(offset=20, limit=10))
    assert (first.total, first.next_offset, len(first.rows)) == (25, 10, 10)
    assert (last.next_offset, len(last.rows)) == (None, 5)


# --- properties
# ----------------------------------------------------------------------------------------

_kinds = st.sampled_from(
    [
        (True, True, Disposition.MIGRATED),
        (False, True, Disposition.FALLBACK_RESTART),
        (False, False, Disposition.FALLBACK_RESTART),
        (False, True, Disposition.NOT_A_FAILURE),
    ]
)
_outcomes = st.lists(
    st.tuples(
        st.integers(0, 40),
        st.integers(0, 500),
        _kinds,
        st.sampled_from(["job-a", "job-b", "job-z"]),
    ),
    max_size=60,
)


def _materialise(
    raw: list[tuple[int, int, tuple[bool, bool, Disposition], str]],
) -> list[MigrationOutcome]:
    out = []
    for n, day, (success, qualifying, disposition), job in raw:
        cls = (
            QUALIFYING
            if qualifying
            else Classification(
                category=Category.UNABLE_TO_RECOVER, qualifying=False, reason="redundancy exceeded"
            )
        )
        at = T0 + timedelta(days=day)
        out.append(
            outcome(n, at, success=success, job=job, classification=cls, disposition=disposition)
        )
    return out


def _ledger(outcomes: list[MigrationOutcome]) -> dict[str, LedgerEntry]:
    book = covered_book("job-a", "job-b")
    for o in outcomes:
        book.record_outcome(o)
    return {k: e._replace(duplicates=0) for k, e in book.entries.items()}


@given(st.integers(0, 10_000), st.integers(0, 10_000))
def test_rate_is_in_unit_interval_and_credit_iff_below_ninety(s: int, extra: int) -> None:
    q = s + extra
    rate = success_rate(s, q)
    if q == 0:
        assert rate is None and not credit_due(s, q)
        return
    assert rate is not None and 0 <= rate <= 1
    assert credit_due(s, q) == (Fraction(s, q) < Fraction(9, 10)) == (10 * s < 9 * q)


@settings(max_examples=60, deadline=None)
@given(_outcomes)
def test_recording_twice_changes_nothing_but_the_duplicate_count(raw: list) -> None:
    outcomes = _materialise(raw)
    once = _ledger(outcomes)
    assert _ledger(outcomes + outcomes) == once


@settings(max_examples=60, deadline=None)
@given(_outcomes, st.randoms(use_true_random=False))
def test_the_tally_does_not_depend_on_arrival_order(raw: list, rnd: random.Random) -> None:
    outcomes = _materialise(raw)
    # distinct incidents only: for a duplicated id the first record wins, which is order by
    # definition
    unique = list({o.incident_id: o for o in outcomes}.values())
    shuffled = unique[:]
    rnd.shuffle(shuffled)
    end = add_months(START, 12)
    a = tally(_ledger(unique).values(), START, end)
    b = tally(_ledger(shuffled).values(), START, end)
    assert a == b
    assert 0 <= a.successful <= a.qualifying


@settings(max_examples=40, deadline=None)
@given(_outcomes)
def test_status_is_excluded_unless_covered_qualifying_and_a_real_failure(raw: list) -> None:
    for o in _materialise(raw):
        covered = o.job_id != "job-z"
        status = status_for(o, EntryStatus.SUCCESS if covered else EntryStatus.NOT_OPTED_IN)
        counted = status in (EntryStatus.SUCCESS, EntryStatus.FAILURE)
        real = o.disposition is not Disposition.NOT_A_FAILURE
        assert counted == (covered and o.classification.qualifying and real)
        assert (status is EntryStatus.SUCCESS) == (counted and o.success)


def test_every_evaluation_instant_is_midnight_utc() -> None:
    assert day_start(START) == datetime(2026, 1, 15, tzinfo=UTC)


def _busy_year(book: ContractBook, per_day: int, days: int, long_ids: bool = False) -> None:
    """`per_day` outcomes a day for `days` days from T0, one in ten failed; ids as long as
    allowed."""
    pad = "x" * (1000 if long_ids else 0)
    for d in range(days):
        for i in range(per_day):
            n = d * per_day + i
            o = outcome(n, T0 + timedelta(days=d, minutes=i), success=n % 10 != 0)
            book.record_outcome(
                o.model_copy(update={"incident_id": f"torchpass-incident:{pad}{n}/run"})
            )


def test_past_its_budget_the_ledger_rolls_old_days_up_and_every_window_counts_the_same(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The carried ledger must fit one continue-as-new payload: past its budget the oldest days
    become counts per day and status. Every tally (standing, evaluation) is what the whole ledger
    would give, also after the state travels; an outcome of a rolled-up day is refused (who was
    counted is no longer known)."""
    whole = covered_book()
    _busy_year(whole, per_day=12, days=40)
    monkeypatch.setattr(ledger, "LEDGER_BUDGET", 100)
    rolled = covered_book()
    _busy_year(rolled, per_day=12, days=40)
    assert (
        len(rolled.entries) <= 100
        and rolled.ledger.rollups
        and rolled.ledger.rolled_through is not None
    )
    assert sum(r.entries for r in rolled.ledger.rollups.values()) + len(rolled.entries) == 480
    now = T0 + timedelta(days=41)
    assert rolled.standing(now).model_dump() == whole.standing(now).model_dump()
    carried = ContractBook(
        rolled.terms, ContractState.model_validate_json(rolled.to_state().model_dump_json())
    )
    assert carried.standing(now).model_dump() == whole.standing(now).model_dump()
    assert carried.ledger.rolled_through == rolled.ledger.rolled_through
    late = outcome(9999, T0 + timedelta(days=1), success=False)
    assert not carried.record_checked(late, "torchpass-incident:late")
    assert "rolled up to counts" in carried.checks.rejected[-1].reason
    counted = carried.standing(now).model_dump(exclude={"rejected_claims"})
    assert counted == whole.standing(now).model_dump(exclude={"rejected_claims"})  # nothing counted


def test_a_years_ledger_of_the_longest_ids_fits_one_payload() -> None:
    """30 failures a day for a year, each incident id 1,000 characters: without roll-ups the state
    is ~40 MB (Temporal refuses a payload over 2 MB and the contract would be stuck); with them it
    stays under the budget."""
    book = covered_book()
    _busy_year(book, per_day=30, days=365, long_ids=True)
    size = len(book.to_state().model_dump_json())
    assert size < 2_000_000, size
    assert sum(r.entries for r in book.ledger.rollups.values()) + len(book.entries) == 30 * 365
