"""`ContractBook`: one contract's running state with the YOCO rules (`torchpass.contract.rules`) applied to
it.

Pure, like the rules: ContractWorkflow holds one and feeds it the time (`workflow.now()`); its state
travels across continue-as-new as one `ContractState`.
"""

from __future__ import annotations

from datetime import date, datetime, timedelta

from torchpass.contract.coverage import CoverageChange, JobCoverage, coverage_of
from torchpass.contract.credit import CreditDelivery
from torchpass.contract.entries import EntryStatus, LedgerEntry
from torchpass.contract.evaluation import Evaluation, EvaluationContext, Trigger
from torchpass.contract.ledger import Ledger
from torchpass.contract.queries import LedgerPage, LedgerPageInput, LedgerRow, Standing
from torchpass.contract.rules import (
    CREDIT_SHARE,
    add_months,
    check_expansion_date,
    check_fee,
    credit_due,
    credit_start,
    day_start,
    evaluate,
    prune_horizon,
    status_for,
    success_rate,
    summary,
    tally,
    validation_status,
    window_for,
)
from torchpass.contract.state import ContractState
from torchpass.contract.terms import (
    ContractPurpose,
    ContractRuleError,
    ContractTerms,
    ExpandInput,
    RenewInput,
)
from torchpass.contract.verify import Quarantine
from torchpass.errors import ErrorType
from torchpass.incident.outcome import MigrationOutcome
from torchpass.validation.report import ValidationReport


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
        self.ledger = Ledger(s.ledger, s.rollups, s.rolled_through)
        self.entries = self.ledger.entries
        self.evaluations = list(s.evaluations)
        self.pending = list(s.pending_credits)
        self.deliveries = list(s.deliveries)
        self.credit_retry_at = s.credit_retry_at  # set by ContractWorkflow when billing did not take one
        self.duplicates, self.rejected_signals, self.pruned = s.duplicates, s.rejected_signals, s.pruned
        self.runs, self.rules_version = s.runs, s.rules_version
        self.lapsed = False
        self.checks = Quarantine(s.unverified, s.rejected, s.rejected_claims)

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
            rollups=tuple(self.ledger.rollups.values()),
            rolled_through=self.ledger.rolled_through,
            evaluations=tuple(self.evaluations),
            pending_credits=tuple(self.pending),
            deliveries=tuple(self.deliveries),
            credit_retry_at=self.credit_retry_at,
            duplicates=self.duplicates,
            rejected_signals=self.rejected_signals,
            pruned=self.pruned,
            runs=self.runs,
            rules_version=self.rules_version,
            unverified=tuple(self.checks.unverified),
            rejected=tuple(self.checks.rejected),
            rejected_claims=self.checks.rejected_claims,
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
            raise ContractRuleError(ErrorType.CONTRACT_UNKNOWN_JOB, f"job {job_id!r} is not opted in")
        return mark

    def opt_out(self, job_id: str, now: datetime) -> JobCoverage:
        self.check_opted_in(job_id)
        job = self.jobs[job_id].with_change(CoverageChange(now, EntryStatus.OPTED_OUT))
        self.jobs[job_id] = job
        return job

    def check_validation(self, report: ValidationReport) -> None:
        if report.contract_id != self.terms.contract_id:
            raise ContractRuleError(
                ErrorType.CONTRACT_WRONG_CONTRACT,
                f"report for contract {report.contract_id!r}, this is {self.terms.contract_id!r}",
            )
        self.check_opted_in(report.job_id)

    def record_validation(self, report: ValidationReport) -> JobCoverage:
        """A report covers (or uncovers) the job from its time, never before the opt-in it answers. One with
        waived checks covers it on a development contract only (`validation_status`)."""
        mark = self.check_opted_in(report.job_id)
        status = validation_status(report, self.terms.purpose)
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

    def receive(self, outcome: MigrationOutcome) -> bool:
        """Hold an outcome until checked (a known incident id is a duplicate at once); False: refused."""
        if outcome.incident_id in self.entries:
            self.record_outcome(outcome)
            return True
        return self.checks.hold(outcome)

    def record_checked(self, outcome: MigrationOutcome, failure_key: str) -> bool:
        """An outcome its check bore out: recorded, unless another run of the same failure's incident
        (`failure_key`, the workflow id the check confirmed) already was; that one is refused."""
        if self.ledger.too_late(outcome.detected_at):
            why = f"detected on {outcome.detected_at:%Y-%m-%d}, a day the ledger has rolled up to counts"
            self.checks.reject(outcome.incident_id, outcome.job_id, outcome.detected_at, why)
            return False
        first = self.ledger.failures.get(failure_key)
        if first is None or first == outcome.incident_id:
            self.record_outcome(outcome)
            return True
        self.duplicates += 1
        why = f"the same failure (job, failure domain, generation) as incident {first}"
        self.checks.reject(outcome.incident_id, outcome.job_id, outcome.detected_at, why)
        return False

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
        self.ledger.add(entry)
        return entry, False

    def prune(self, today: date) -> int:
        """Drop what no future window can count, so the carried ledger stays bounded; returns how many."""
        cutoff = day_start(prune_horizon(self.term_start, self.last_evaluated(), today))
        pruned = self.ledger.prune(cutoff)
        self.pruned += pruned
        return pruned

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
            purpose=self.terms.purpose,
        )
        ev = evaluate(ctx, self.ledger.counted())
        self.evaluations.append(ev)
        if ev.credit is not None:
            self.pending.append(ev.credit)
        return ev

    def check_expand(self, inp: ExpandInput, today: date) -> None:
        if self.awaiting_renewal:
            raise ContractRuleError(
                ErrorType.CONTRACT_AWAITING_RENEWAL,
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
                ErrorType.CONTRACT_DATES_OUT_OF_ORDER,
                f"next renewal {inp.next_renewal} must be after the coming one, {self.renewal_date}",
            )
        if today is not None and inp.next_renewal <= today:
            raise ContractRuleError(
                ErrorType.CONTRACT_DATES_OUT_OF_ORDER,
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
        t = tally(self.ledger.counted(), start, end)
        unpaid = tally(self.ledger.counted(), credit_start(start, end, self.last_credited()), end)
        projected = None
        if (
            credit_due(t.successful, t.qualifying)
            and credit_due(unpaid.successful, unpaid.qualifying)
            and not self.credited_this_term()
            and self.terms.purpose is ContractPurpose.CUSTOMER
        ):
            projected = self.fee.times(CREDIT_SHARE)
        return Standing(
            customer_id=self.terms.customer_id,
            contract_id=self.terms.contract_id,
            purpose=self.terms.purpose,
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
            unverified=len(self.checks.unverified),
            rejected_claims=self.checks.rejected_claims,
            runs=self.runs,
        )

    def ledger_page(self, inp: LedgerPageInput) -> LedgerPage:
        entries = list(self.entries.values())
        page = entries[inp.offset : inp.offset + inp.limit]
        more = inp.offset + inp.limit < len(entries)
        return LedgerPage(
            purpose=self.terms.purpose,
            rows=tuple(LedgerRow.of(e) for e in page),
            total=len(entries),
            next_offset=inp.offset + inp.limit if more else None,
            pruned=self.pruned,
            rolled_up=tuple(self.ledger.rollups.values()),
            rejected=tuple(self.checks.rejected),
        )
