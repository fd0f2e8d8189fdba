"""`ContractBook`: one contract's running state with the YOCO rules (`torchpass.contract.rules`)
applied to it: the outcomes it records, the evaluations at each term's close and each expansion, and
what it answers.

Its parts keep their own rules: the term running now and its renewal
(`torchpass.contract.renewal.Term`), the jobs' coverage (`torchpass.contract.coverage.Jobs`), the
evaluations and the credits they owe (`torchpass.contract.evaluation.Evaluations`), the ledger
(`torchpass.contract.ledger.Ledger`) and the outcomes awaiting their check
(`torchpass.contract.verify.Quarantine`).

Pure, like the rules: ContractWorkflow holds one and feeds it the time (`workflow.now()`); its state
travels across continue-as-new as one `ContractState`.
"""

from __future__ import annotations

from datetime import date, datetime, timedelta

from torchpass.contract.coverage import Jobs
from torchpass.contract.entries import COUNTED, EntryStatus, LedgerEntry
from torchpass.contract.evaluation import Evaluation, EvaluationContext, Evaluations, Trigger
from torchpass.contract.ledger import Ledger
from torchpass.contract.queries import LedgerPage, LedgerPageInput, LedgerRow, Standing
from torchpass.contract.renewal import Term
from torchpass.contract.rules import (
    CREDIT_SHARE,
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
    window_for,
)
from torchpass.contract.state import ContractState
from torchpass.contract.terms import ContractPurpose, ContractRuleError, ContractTerms, ExpandInput
from torchpass.contract.verify import Quarantine
from torchpass.errors import ErrorType
from torchpass.incident.outcome import MigrationOutcome


class ContractBook:
    """A contract's running state and the rules applied to it; `check_*` only read, the rest change
    it.

    ContractWorkflow calls `check_*` from its update validators (a refusal is a typed error to the
    caller and leaves no trace in history) and the matching method from the handler, on the book or
    on the part the update is about (`term`, `jobs`)."""

    def __init__(self, terms: ContractTerms, state: ContractState | None = None) -> None:
        s = state or ContractState(
            term_start=terms.start, renewal_date=terms.renewal_date, annual_fee=terms.annual_fee
        )
        self.terms = terms
        self.term = Term(terms, s)
        self.jobs = Jobs(terms, s.jobs)
        self.ledger = Ledger(s.ledger, s.rollups, s.rolled_through)
        self.entries = self.ledger.entries
        self.evaluations = Evaluations(
            s.evaluations, s.pending_credits, s.deliveries, s.credit_retry_at
        )
        self.duplicates, self.rejected_signals, self.pruned = (
            s.duplicates,
            s.rejected_signals,
            s.pruned,
        )
        self.runs, self.rules_version = s.runs, s.rules_version
        self.checks = Quarantine(s.unverified, s.rejected, s.rejected_claims)

    def to_state(self) -> ContractState:
        return ContractState(
            term=self.term.number,
            term_start=self.term.start,
            renewal_date=self.term.renewal_date,
            annual_fee=self.term.fee,
            renewal=self.term.renewal,
            awaiting_renewal=self.term.awaiting_renewal,
            jobs=tuple(self.jobs.coverage.values()),
            ledger=tuple(self.entries.values()),
            rollups=tuple(self.ledger.rollups.values()),
            rolled_through=self.ledger.rolled_through,
            evaluations=tuple(self.evaluations.closed),
            pending_credits=tuple(self.evaluations.pending_credits),
            deliveries=tuple(self.evaluations.deliveries),
            credit_retry_at=self.evaluations.credit_retry_at,
            duplicates=self.duplicates,
            rejected_signals=self.rejected_signals,
            pruned=self.pruned,
            runs=self.runs,
            rules_version=self.rules_version,
            unverified=tuple(self.checks.unverified),
            rejected=tuple(self.checks.rejected),
            rejected_claims=self.checks.rejected_claims,
        )

    # --- outcomes
    # --------------------------------------------------------------------------------------

    def receive(self, outcome: MigrationOutcome) -> bool:
        """Hold an outcome until checked (a known incident id is a duplicate at once); False:
        refused."""
        if outcome.incident_id in self.entries:
            self.record_outcome(outcome)
            return True
        return self.checks.hold(outcome)

    def record_checked(
        self, outcome: MigrationOutcome, failure_key: str, attested: bool = True
    ) -> bool:
        """An outcome its check bore out: recorded, unless another run of the same failure's
        incident (`failure_key`, the workflow id the check confirmed) already was; that one is
        refused."""
        if self.ledger.too_late(outcome.detected_at):
            why = (
                f"detected on {outcome.detected_at:%Y-%m-%d}, a day the ledger has rolled up to "
                "counts"
            )
            self.checks.reject(outcome.incident_id, outcome.job_id, outcome.detected_at, why)
            return False
        first = self.ledger.failures.get(failure_key)
        if first is None or first == outcome.incident_id:
            self.record_outcome(outcome, attested)
            return True
        self.duplicates += 1
        why = f"the same failure (job, failure domain, generation) as incident {first}"
        self.checks.reject(outcome.incident_id, outcome.job_id, outcome.detected_at, why)
        return False

    def record_outcome(
        self, outcome: MigrationOutcome, attested: bool = True
    ) -> tuple[LedgerEntry, bool]:
        """The ledger entry of an outcome, and whether it was a duplicate (then nothing else
        changes). One its job never `attested` is unconfirmed where it would count: kept, never
        counted."""
        known = self.entries.get(outcome.incident_id)
        if known is not None:
            self.duplicates += 1
            entry = known._replace(duplicates=known.duplicates + 1)
            self.entries[outcome.incident_id] = entry
            return entry, True
        closed = self.evaluations.last_evaluated()
        status = status_for(outcome, self.jobs.status(outcome.job_id, outcome.detected_at))
        if not attested and status in COUNTED:  # an uncovered job's keeps its own reason
            status = EntryStatus.UNCONFIRMED
        late = closed is not None and outcome.detected_at < day_start(closed)
        recovery = None if outcome.recovery_seconds is None else round(outcome.recovery_seconds, 3)
        entry = LedgerEntry(
            outcome.incident_id, outcome.job_id, outcome.detected_at, status, late, 0, recovery
        )
        self.ledger.add(entry)
        return entry, False

    def prune(self, today: date) -> int:
        """Drop what no future window can count, so the carried ledger stays bounded; returns how
        many."""
        cutoff = day_start(prune_horizon(self.term.start, self.evaluations.last_evaluated(), today))
        pruned = self.ledger.prune(cutoff)
        self.pruned += pruned
        return pruned

    # --- evaluations: at each term's close and each expansion
    # --------------------------------------------

    def _evaluate(
        self, trigger: Trigger, period_end: date, apply_to: str, now: datetime
    ) -> Evaluation:
        ctx = EvaluationContext(
            customer_id=self.terms.customer_id,
            contract_id=self.terms.contract_id,
            contract_start=self.terms.start,
            term=self.term.number,
            trigger=trigger,
            period_end=period_end,
            # the fee in force over the period measured, before this event changes it
            fee=self.term.fee,
            apply_to=apply_to,
            credit_already_this_term=self.evaluations.credited_in(self.term.number),
            now=now,
            credited_through=self.evaluations.last_credited(),
            purpose=self.terms.purpose,
        )
        return self.evaluations.add(evaluate(ctx, self.ledger.counted()))

    def check_expand(self, inp: ExpandInput, today: date) -> None:
        term = self.term
        if term.awaiting_renewal:
            raise ContractRuleError(
                ErrorType.CONTRACT_AWAITING_RENEWAL,
                f"the term ended {term.renewal_date} without a renewal: renew first (until "
                f"{term.grace_ends()}), then expand",
            )
        check_fee(term.fee, inp.annual_fee)
        earliest = max(term.start, self.evaluations.last_evaluated() or term.start)
        check_expansion_date(inp.on, earliest, today)

    def expand(self, inp: ExpandInput, now: datetime) -> Evaluation:
        """Evaluate at the expansion (once per date: a second one that day is not evaluated
        again)."""
        self.check_expand(inp, now.date())
        if self.evaluations.evaluated_on(inp.on):
            ev = Evaluation(
                trigger=Trigger.EXPANSION,
                term=self.term.number,
                period_start=window_for(self.terms.start, inp.on)[0],
                period_end=inp.on,
                evaluated=False,
                fee=self.term.fee,
                note="not evaluated: this date was already evaluated",
            )
            self.evaluations.add(ev)
        else:
            ev = self._evaluate(Trigger.EXPANSION, inp.on, f"expansion on {inp.on}", now)
        self.term.fee = inp.annual_fee
        return ev

    def close_term(self, now: datetime) -> Evaluation:
        """The renewal date came: evaluate the term, then start the next one, or (not renewed) await
        a late renewal for `terms.renewal_grace_days`, keeping the term, its dates and the
        ledger."""
        term = self.term
        apply_to = (
            f"renewal on {term.renewal_date}" if term.renewal else "next renewal or expansion"
        )
        ev = self._evaluate(Trigger.RENEWAL, term.renewal_date, apply_to, now)
        term.end()
        return ev

    # --- queries
    # ---------------------------------------------------------------------------------------

    def standing(self, now: datetime) -> Standing:
        """The window as if evaluated at the end of today, and the credit it would earn."""
        start, end = window_for(self.terms.start, now.date() + timedelta(days=1))
        t = tally(self.ledger.counted(), start, end)
        term, credits = self.term, self.evaluations
        unpaid = tally(
            self.ledger.counted(), credit_start(start, end, credits.last_credited()), end
        )
        projected = None
        if (
            credit_due(t.successful, t.qualifying)
            and credit_due(unpaid.successful, unpaid.qualifying)
            and not credits.credited_in(term.number)
            and self.terms.purpose is ContractPurpose.CUSTOMER
        ):
            projected = term.fee.times(CREDIT_SHARE)
        return Standing(
            customer_id=self.terms.customer_id,
            contract_id=self.terms.contract_id,
            purpose=self.terms.purpose,
            enrolment_key=self.terms.enrolment_key,
            term=term.number,
            term_start=term.start,
            renewal_date=term.renewal_date,
            annual_fee=term.fee,
            renewed=term.renewal is not None,
            awaiting_renewal=term.awaiting_renewal and not term.lapsed,
            renewal_grace_ends=term.grace_ends() if term.awaiting_renewal else None,
            lapsed=term.lapsed,
            window_start=start,
            window_end=end,
            qualifying=t.qualifying,
            successful=t.successful,
            excluded=dict(t.excluded),
            success_rate=success_rate(t.successful, t.qualifying),
            summary=summary(t),
            projected_credit=projected,
            next_evaluation=None if term.lapsed or term.awaiting_renewal else term.renewal_date,
            covered_jobs=self.jobs.covered(now),
            evaluations=tuple(credits.closed),
            pending_credits=len(credits.pending_credits),
            next_credit_retry=credits.credit_retry_at if credits.pending_credits else None,
            delivered_credits=tuple(d.idempotency_key for d in credits.deliveries),
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
