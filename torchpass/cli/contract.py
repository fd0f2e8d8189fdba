"""`torchpass contract create|opt-in|validate|show|ledger|expand|renew`: a YOCO contract from the
shell.

Every command speaks to the contract's workflow through `workers.contract_client`; `show` prints the
standing as a table (`--json` for machines), `ledger` every recorded outcome with why it counts or
not. `create --development` makes a development contract (waived checks accepted, no credit to
billing); `opt-in` and `validate` print each check as ok, FAIL or WAIVED and exit 0 only when the
job is covered.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from datetime import date
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from temporalio.client import Client

from job_agent.coordinator.private_files import open_private
from torchpass.cli.common import CliError, connect
from torchpass.contract.credit import Money
from torchpass.contract.queries import LedgerRow, Standing
from torchpass.contract.rules import add_months, day_start
from torchpass.contract.terms import (
    DEVELOPMENT_BANNER,
    ContractPurpose,
    ContractTerms,
    ExpandInput,
    RenewInput,
)
from torchpass.incident.attestation import JobKey
from torchpass.render import format_check, format_ledger, format_standing
from torchpass.validation.report import ReportStatus, ValidationReport
from workers import contract_client as cc


def _amount(text: str) -> Decimal:
    try:
        d = Decimal(text.replace(",", "").replace("_", ""))
    except InvalidOperation:
        raise argparse.ArgumentTypeError(f"not an amount: {text!r}") from None
    if not d.is_finite():
        raise argparse.ArgumentTypeError(f"not an amount: {text!r}")
    return d


def _ids(p: argparse.ArgumentParser) -> None:
    p.add_argument("--customer", required=True, help="customer id")
    p.add_argument("--contract", required=True, help="contract id")


def register(sub: Any, temporal_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add `contract` and its subcommands to the CLI's subparsers."""
    c = sub.add_parser(
        "contract", help="YOCO contracts: create, opt jobs in, standing, ledger, credits"
    )
    csub = c.add_subparsers(dest="contract_command", required=True)
    cr = csub.add_parser("create", help="start a contract's workflow")
    cr.add_argument("--start", type=date.fromisoformat, required=True, help="first day, YYYY-MM-DD")
    cr.add_argument(
        "--renewal", type=date.fromisoformat, help="renewal date (default: start + 1 year)"
    )
    cr.add_argument("--fee", type=_amount, required=True, help="annual license fee, e.g. 120000")
    cr.add_argument("--currency", default="USD")
    cr.add_argument(
        "--enrolment-key",
        help="the public half of the cluster's enrolment key (hex, from `contract enrolment-key`): "
        "only jobs whose keys it vouched for are covered",
    )
    cr.add_argument(
        "--development",
        action="store_true",
        help="a development contract: validations with waived checks (--allow-local) cover a job, "
        "and it never issues a credit to billing; not a customer guarantee",
    )
    o = csub.add_parser("opt-in", help="opt a job in and validate its environment")
    o.add_argument("--job", required=True)
    o.add_argument("--task-queue", help="the job's task queue (default: torchpass-job-<job>)")
    o.add_argument("--no-validate", action="store_true", help="opt in only; validate later")
    local = (
        "waive the scheduler check on a host with neither Slurm nor Kubernetes (development "
        "contracts only)"
    )
    o.add_argument("--allow-local", action="store_true", help=local)
    v = csub.add_parser("validate", help="(re)validate an opted-in job's environment")
    v.add_argument("--job", required=True)
    v.add_argument("--task-queue")
    v.add_argument("--allow-local", action="store_true", help=local)
    s = csub.add_parser("show", help="the standing: window counts, rate, projected credit")
    s.add_argument("--json", action="store_true")
    lg = csub.add_parser("ledger", help="every recorded outcome and whether it counts")
    lg.add_argument("--offset", type=int, default=0)
    lg.add_argument("--limit", type=int, default=200)
    lg.add_argument("--json", action="store_true")
    e = csub.add_parser(
        "expand", help="record an expansion (evaluated after 3 months of measurement)"
    )
    e.add_argument("--on", type=date.fromisoformat, required=True)
    e.add_argument(
        "--fee", type=_amount, required=True, help="the annual fee from the expansion on"
    )
    e.add_argument("--currency", default="USD")
    r = csub.add_parser("renew", help="renew for another term (evaluated at the renewal date)")
    r.add_argument("--fee", type=_amount, help="the next term's annual fee (default: unchanged)")
    r.add_argument("--currency", default="USD")
    r.add_argument("--next-renewal", type=date.fromisoformat)
    for p in (cr, o, v, s, lg, e, r):
        _ids(p)
        temporal_args(p)
    ek = csub.add_parser(
        "enrolment-key",
        help="make the cluster's enrolment key pair: the private half to a file for the job hosts "
        "(0600), the public half printed, for `contract create --enrolment-key`",
    )
    ek.add_argument("--out", type=Path, required=True, help="where the private half is written")
    temporal_args(ek)


def make_enrolment_key(out: Path) -> int:
    """`torchpass contract enrolment-key`: a new pair; never over an existing file."""
    key = JobKey.generate()
    try:
        f = open_private(out, "x")
    except OSError as e:
        raise CliError(f"cannot write the enrolment key to {out}: {e}") from None
    with f:
        f.write(key.private_hex() + "\n")
    print(key.public)
    return 0


async def run(args: argparse.Namespace, settings: Any) -> int:
    if args.contract_command == "enrolment-key":
        return make_enrolment_key(args.out)
    if getattr(args, "fee", None) is not None:
        _money(args)  # a fee no contract can hold is refused before anything else happens
    client = await connect(settings)
    try:
        return await _run(args, client)
    except cc.ContractClientError as e:
        raise CliError(f"contract {args.contract} of {args.customer}: {e}") from None


async def _run(args: argparse.Namespace, client: Client) -> int:
    cmd, cust, cid = args.contract_command, args.customer, args.contract
    if cmd == "create":
        start: date = args.start
        terms = ContractTerms(
            customer_id=cust,
            contract_id=cid,
            start=start,
            renewal_date=args.renewal or add_months(start, 12),
            annual_fee=Money(amount=args.fee, currency=args.currency),
            purpose=ContractPurpose.DEVELOPMENT if args.development else ContractPurpose.CUSTOMER,
            enrolment_key=args.enrolment_key,
        )
        h = await cc.create_contract(client, terms)
        if args.development:
            print(DEVELOPMENT_BANNER)
        print(
            f"{terms.purpose.value} contract {cid} of {cust}: workflow {h.id}, renewal "
            f"{terms.renewal_date}"
        )
    elif cmd == "opt-in":
        cov = await cc.opt_in(client, cust, cid, args.job)
        print(f"job {args.job}: {cov.changes[-1].status.value if cov.changes else 'opted in'}")
        if not args.no_validate:
            return await _validate(args, client)
    elif cmd == "validate":
        return await _validate(args, client)
    elif cmd == "show":
        st = await cc.get_standing(client, cust, cid)
        print(st.model_dump_json(indent=2) if args.json else format_standing(st))
    elif cmd == "ledger":
        page = await cc.get_ledger(client, cust, cid, args.offset, args.limit)
        print(page.model_dump_json(indent=2) if args.json else format_ledger(page))
    elif cmd == "expand":
        ev = await cc.expand(client, cust, cid, ExpandInput(on=args.on, annual_fee=_money(args)))
        print(f"expansion on {args.on}: {ev.note}")
    elif cmd == "renew":
        fee = _money(args) if args.fee is not None else None
        st = await cc.renew(
            client, cust, cid, RenewInput(annual_fee=fee, next_renewal=args.next_renewal)
        )
        if not st.renewed:
            # A late renewal (the term had ended): the next term started from the passed renewal
            # date.
            print(
                f"renewed late: term {st.term + 1} runs from {st.term_start} to {st.renewal_date}"
            )
        else:
            print(
                f"renewal recorded: the term ending {st.renewal_date} is evaluated then and renewed"
            )
    return 0


def _money(args: argparse.Namespace) -> Money:
    return Money(amount=args.fee, currency=args.currency)


async def _validate(args: argparse.Namespace, client: Client) -> int:
    from temporalio.client import WorkflowFailureError
    from temporalio.exceptions import WorkflowAlreadyStartedError

    try:
        report = await cc.validate_job(
            client, args.customer, args.contract, args.job, args.task_queue or "", args.allow_local
        )
    except WorkflowAlreadyStartedError:
        raise CliError(
            f"a validation of job {args.job} is already running; try again when it ends"
        ) from None
    except WorkflowFailureError as e:
        raise CliError(f"validation of job {args.job} did not complete: {e.cause or e}") from None
    for check in report.checks:
        print(f"  {format_check(check)}")
    # The contract's record decides, not the report: a waived check covers on a development contract
    # only.
    standing = None
    if report.status is not ReportStatus.FAILED:
        standing = await cc.get_standing(client, args.customer, args.contract)
    covered = standing is not None and args.job in standing.covered_jobs
    print(f"job {args.job}: {coverage_line(report, standing, covered)}")
    return 0 if covered else 1


def coverage_line(report: ValidationReport, standing: Standing | None, covered: bool) -> str:
    """The last line of `opt-in`/`validate`: covered, not covered (and why), or validation
    failed."""
    waived = ", ".join(report.waived)
    if covered:
        dev = standing is not None and standing.purpose is ContractPurpose.DEVELOPMENT
        return f"covered (development contract: {waived} waived)" if dev and waived else "covered"
    if report.status is ReportStatus.FAILED:
        return "validation failed, not covered"
    if report.status is ReportStatus.PASSED_WITH_WAIVERS:
        return f"not covered (waived checks on a customer contract): {waived} waived"
    return "not covered: the contract does not record the job as covered (opted out meanwhile?)"


async def contract_ledger_rows(
    client: Client, customer_id: str, contract_id: str
) -> list[LedgerRow]:
    """The counted ledger rows of the contract's current trailing window (the standing's), from the
    contract alone: each row carries its recovery time, so no incident workflow is read (Temporal's
    retention may have deleted them) and thousands of outcomes are a few queries."""
    standing = await cc.get_standing(client, customer_id, contract_id)
    lo, hi = day_start(standing.window_start), day_start(standing.window_end)
    rows: list[LedgerRow] = []
    offset: int | None = 0
    while offset is not None:
        page = await cc.get_ledger(client, customer_id, contract_id, offset, 1000)
        rows += [r for r in page.rows if r.counted and lo <= r.detected_at < hi]
        offset = page.next_offset
    return rows
