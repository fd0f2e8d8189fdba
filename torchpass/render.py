"""Plain-text renderings for SREs: an incident's outcome, a contract's standing and ledger, a
validation.

Pure functions of the core's models; `torchpass incidents show`, `torchpass contract
show|ledger|opt-in`, `torchpass audit` and the demo print them. A development contract's standing
and ledger open with `DEVELOPMENT_BANNER`.
"""

from __future__ import annotations

from torchpass.contract.audit import Audit
from torchpass.contract.queries import LedgerPage, Standing
from torchpass.contract.terms import DEVELOPMENT_BANNER, ContractPurpose
from torchpass.incident.outcome import MigrationOutcome
from torchpass.validation.report import CheckResult, CheckStatus

_MARK = {CheckStatus.PASSED: "ok", CheckStatus.FAILED: "FAIL", CheckStatus.WAIVED: "WAIVED"}


def format_check(c: CheckResult) -> str:
    """One validation check as `ok`, `FAIL` or `WAIVED`, its name and what it saw."""
    return f"{_MARK[c.status]:<6} {c.name:<20} {c.detail}"


def _banner(purpose: ContractPurpose) -> list[str]:
    return [DEVELOPMENT_BANNER] if purpose is ContractPurpose.DEVELOPMENT else []


def format_outcome(o: MigrationOutcome) -> str:
    """An incident as an SRE reads it; every figure is one the job measured (see
    `MigrationOutcome`)."""
    lines = [
        f"incident   {o.incident_id}",
        f"job        {o.job_id}   domain {o.failure_domain}   lost ranks {list(o.lost_slots)}",
        f"kind       {o.kind}   ({o.evidence_count} report(s))",
        f"class      {o.classification.category} - "
        f"{'qualifying' if o.classification.qualifying else 'disqualifying'}: "
        f"{o.classification.reason}",
        f"outcome    {o.disposition}   success={o.success}   steps recomputed {o.steps_recomputed}"
        " (measured from the ranks' step reports)",
    ]
    if o.step_before is not None and o.resumed_steps:
        resumed = sorted(set(o.resumed_steps.values()))
        lines.append(
            f"steps      last completed {o.step_before}; ranks resumed at {_steps(resumed)}"
        )
    if o.recovery_seconds is not None:
        lines.append(
            f"recovery   {o.recovery_seconds:.3f} s from detection to all ranks training again"
        )
    if o.recovery_from_last_progress_seconds is not None:
        lines.append(
            f"           {o.recovery_from_last_progress_seconds:.3f} s from the hung rank's last "
            "progress"
        )
    for p in o.phases:
        work = f"  (in activity {p.work_seconds:.3f} s)" if p.work_seconds is not None else ""
        lines.append(f"  {p.phase:<9} {p.seconds:7.3f} s{work}")
    if o.proof is not None:
        lines += _proof_lines(o)
    if o.fallback is not None:
        lines.append(
            f"fallback   restored step {o.fallback.restored_step}, {o.fallback.steps_recomputed} "
            "recomputed"
        )
    if o.error:
        lines.append(f"error      {o.error}")
    return "\n".join(lines)


def _steps(steps: list[int]) -> str:
    return str(steps[0]) if len(steps) == 1 else f"steps {steps} (NOT all the same)"


def _proof_lines(o: MigrationOutcome) -> list[str]:
    pr = o.proof
    assert pr is not None
    lines = [
        f"proof      donor rank {pr.donor_slot} -> ranks {list(pr.receiver_slots)}, step "
        f"{pr.step_before} -> {pr.step_after}, {pr.bytes / 1e6:.1f} MB in {pr.seconds:.3f} s",
        f"           donor served step {pr.donor_step}, digest {pr.donor_digest[:16]}...",
    ]
    for r in pr.receivers:
        same = "=" if r.installed_digest == pr.donor_digest else "DIFFERENT"
        lines.append(
            f"           rank {r.slot} installed step {r.installed_step}, its own digest "
            f"{r.installed_digest[:16]}... ({same})"
        )
    if not pr.receivers:
        lines.append("           no state moved: every rank already held the frozen step")
    return lines


def format_standing(st: Standing) -> str:
    rate = f"{st.success_rate:.2%}" if st.success_rate is not None else "n/a"
    credit = str(st.projected_credit) if st.projected_credit else "none"
    rows = [
        (
            "contract",
            f"{st.contract_id} of {st.customer_id}, term {st.term + 1} from {st.term_start}",
        ),
        ("purpose", st.purpose.value),
        ("annual fee", str(st.annual_fee)),
        ("window", f"{st.window_start} .. {st.window_end} (trailing 12 months)"),
        ("qualifying", str(st.qualifying)),
        ("successful", str(st.successful)),
        ("success rate", f"{rate}  (guarantee: at least 90%)"),
        ("projected credit", credit),
        ("next evaluation", str(st.next_evaluation or "none")),
        ("renewal", _renewal(st)),
        ("covered jobs", ", ".join(st.covered_jobs) or "none"),
        ("excluded", ", ".join(f"{k.value} {v}" for k, v in st.excluded.items() if v) or "none"),
        ("duplicates", str(st.duplicates)),
        (
            "unverified",
            f"{st.unverified} awaiting their check, {st.rejected_claims} claims refused",
        ),
        ("credits delivered", ", ".join(st.delivered_credits) or "none"),
        ("credits pending", str(st.pending_credits)),
    ]
    lines = [*_banner(st.purpose), *(f"{k:<18} {v}" for k, v in rows)]
    lines.append(f"{'':<18} {st.summary}")
    for ev in st.evaluations:
        got = f"{ev.success_rate:.2%}" if ev.success_rate is not None else "n/a"
        amount = f", credit {ev.credit.amount}" if ev.credit else ""
        lines.append(
            f"evaluation         {ev.period_end} {ev.trigger.value}: {got}{amount} ({ev.note})"
        )
    return "\n".join(lines)


def _renewal(st: Standing) -> str:
    if st.lapsed:
        return "not renewed: the contract has lapsed"
    if st.awaiting_renewal:
        return (
            f"AWAITING RENEWAL: the term ended {st.renewal_date} unrenewed; `renew` until "
            f"{st.renewal_grace_ends} starts the next term from {st.renewal_date}, else it lapses "
            "then"
        )
    return "renewed" if st.renewed else f"due {st.renewal_date}"


def format_ledger(page: LedgerPage) -> str:
    lines = [
        *_banner(page.purpose),
        f"{'detected (UTC)':<20} {'job':<16} {'status':<22} {'counted':<8} incident",
    ]
    for r in page.rows:
        flags = " (late)" if r.late else ""
        flags += f" (+{r.duplicates} duplicate)" if r.duplicates else ""
        lines.append(
            f"{r.detected_at:%Y-%m-%d %H:%M:%S}  {r.job_id:<16} {r.status.value:<22} "
            f"{'yes' if r.counted else 'no':<8} {r.incident_id}{flags}"
        )
        if r.reason:
            lines.append(f"{'':<20} {r.reason}")
    more = f", next page: --offset {page.next_offset}" if page.next_offset is not None else ""
    lines.append(
        f"{len(page.rows)} of {page.total} entries ({page.pruned} pruned as too old){more}"
    )
    if page.rolled_up:
        days = sorted({r.day for r in page.rolled_up})
        n = sum(r.entries for r in page.rolled_up)
        lines.append(
            f"rolled up to counts per day (the ledger passed its budget): {n} earlier entries,"
            f" {days[0]} to {days[-1]}"
        )
    if page.rejected:
        lines.append(f"refused, never counted (the latest {len(page.rejected)}):")
        lines += [
            f"  {r.at:%Y-%m-%d %H:%M:%S}  {r.job_id:<16} {r.claim}: {r.reason}"
            for r in page.rejected
        ]
    return "\n".join(lines)


def format_audit(result: Audit, qualifying: int, successful: int) -> str:
    """`torchpass audit`: what it read, the window's counts both ways, then every disagreement."""
    lines = [
        f"read {result.incidents} incident run(s) of the contract and {result.validations} genuine "
        "validation(s)",
        f"{'':<10} {'qualifying':>10} {'successful':>10}",
        f"{'ledger':<10} {qualifying:>10} {successful:>10}",
        f"{'audit':<10} {result.qualifying:>10} {result.successful:>10}",
    ]
    if not result.findings:
        agree = (result.qualifying, result.successful) == (qualifying, successful)
        lines.append("the ledger agrees with the histories" if agree else "the counts disagree")
        return "\n".join(lines)
    lines.append(f"{len(result.findings)} disagreement(s):")
    lines.append(f"{'ledger':<22} {'audit':<22} {'job':<16} incident: why")
    for f in result.findings:
        ledger = f.ledger.value if f.ledger else "(none)"
        audited = f.audit.value if f.audit else "(not borne out)"
        lines.append(f"{ledger:<22} {audited:<22} {f.job_id:<16} {f.incident_id}: {f.why}")
    return "\n".join(lines)
