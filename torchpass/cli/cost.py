"""`torchpass cost`: what failures cost a cluster per month, and what live migration saves.

Every flag is optional; an unset one takes `CostInputs`' default (the vendor's published
assumptions), so the defaults live in one place. `--contract ID` replaces the success rate and
migration time by the ones measured on the contract's real outcomes, through a lookup the caller
passes in.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Awaitable, Callable, Sequence
from decimal import Decimal, InvalidOperation
from typing import Any

from torchpass.cli.common import CliError, connect
from torchpass.contract.cost import (
    HOURS_PER_MONTH,
    CostInputs,
    MonthlyCost,
    inputs_from_ledger,
    monthly_cost,
)
from torchpass.contract.credit import Money
from torchpass.contract.queries import LedgerRow

LedgerLookup = Callable[[str], Awaitable[Sequence[LedgerRow]]]
"""`async def ledger_for_contract(contract_id) -> list[LedgerRow]`: the rows of the contract's
current trailing window, wired by `run_with_contract`
(`torchpass.cli.contract.contract_ledger_rows`)."""

CONTRACT_LOOKUP_TIMEOUT_S = 30.0

# flag -> CostInputs field; `dest` is the field name so that `run` can pass on the ones given.
_FLAGS: tuple[tuple[str, str, str, str], ...] = (
    ("--gpus", "gpus", "N", "GPUs of the job"),
    ("--price-per-gpu-hour", "gpu_hour_price", "PRICE", "price of one GPU-hour, in --currency"),
    ("--currency", "currency", "CODE", "ISO 4217 code of the price"),
    ("--mttf-hours", "mttf_hours", "HOURS", "mean time to failure of the whole job"),
    (
        "--checkpoint-interval-hours",
        "checkpoint_interval_hours",
        "HOURS",
        "time between checkpoints",
    ),
    ("--replace-minutes", "replace_minutes", "MINUTES", "time to provision a replacement node"),
    ("--restart-minutes", "restart_minutes", "MINUTES", "time to restart the job"),
    ("--restore-minutes", "restore_minutes", "MINUTES", "time to load the last checkpoint"),
    (
        "--migration-seconds",
        "migration_seconds",
        "SECONDS",
        "pause of the job for one live migration",
    ),
    ("--success-rate", "success_rate", "RATE", "share of failures live-migrated, 0..1"),
)
_MEASURED = ("migration_seconds", "success_rate")


def _decimal(text: str) -> Decimal:
    # argparse only turns ValueError/TypeError into a usage error; Decimal raises InvalidOperation.
    try:
        return Decimal(text)
    except InvalidOperation:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def register(sub: Any) -> argparse.ArgumentParser:
    """Add the `cost` command to the subparsers object of the `torchpass` parser."""
    p: argparse.ArgumentParser = sub.add_parser(
        "cost",
        help="what failures cost per month, with and without live migration",
        description=(
            f"The four costs of every failure per month ({HOURS_PER_MONTH} h), beside the cost "
            "with live migration. Defaults: the vendor's published assumptions."
        ),
    )
    for flag, field, metavar, text in _FLAGS:
        default = CostInputs.model_fields[field].default
        kind: Callable[[str], Any] = (
            int if field == "gpus" else str if field == "currency" else _decimal
        )
        # --gpu-hour-usd: the spelling of the issue, kept as an alias.
        flags = (flag, "--gpu-hour-usd") if field == "gpu_hour_price" else (flag,)
        p.add_argument(
            *flags,
            dest=field,
            type=kind,
            default=None,
            metavar=metavar,
            help=f"{text} (default {default})",
        )
    p.add_argument(
        "--contract",
        default=None,
        metavar="ID",
        help="measure success rate and migration time on this contract's recorded outcomes",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def run(args: argparse.Namespace, ledger_for_contract: LedgerLookup | None = None) -> int:
    """Compute and print; invalid inputs raise pydantic's ValidationError (the CLI exits 2 on
    it)."""
    given = {f: getattr(args, f) for _, f, _, _ in _FLAGS if getattr(args, f, None) is not None}
    inputs = CostInputs(**given)
    if args.contract is not None:
        inputs = _measured(inputs, args.contract, given, ledger_for_contract)
    result = monthly_cost(inputs)
    if args.json:
        print(json.dumps(result.model_dump(mode="json"), indent=2))
    else:
        print(render(result, contract=args.contract))
    return 0


def _measured(
    inputs: CostInputs, contract_id: str, given: dict[str, Any], lookup: LedgerLookup | None
) -> CostInputs:
    from torchpass.contract.cost import NoQualifyingOutcomes

    clash = [flag for flag, field, _, _ in _FLAGS if field in _MEASURED and field in given]
    if clash:
        raise CliError(f"--contract measures {' and '.join(clash)}; drop one or the other")
    if lookup is None:
        raise CliError(
            "contract lookup needs the contract store: this build of `torchpass cost` has no "
            "ledger_for_contract wired; pass --success-rate and --migration-seconds instead"
        )
    try:
        rows = asyncio.run(asyncio.wait_for(lookup(contract_id), CONTRACT_LOOKUP_TIMEOUT_S))
    except TimeoutError:
        raise CliError(
            f"no answer for contract {contract_id!r} in {CONTRACT_LOOKUP_TIMEOUT_S:.0f} s"
        ) from None
    try:
        return inputs_from_ledger(inputs, rows)
    except NoQualifyingOutcomes as e:
        raise CliError(f"contract {contract_id!r}: {e}") from None


def _m(money: Money) -> str:
    return f"{money.amount:,.2f}"


def render(result: MonthlyCost, contract: str | None = None) -> str:
    """The table `torchpass cost` prints."""
    i, before, after = result.inputs, result.without_migration, result.with_migration
    idle = i.replace_minutes + i.restart_minutes + i.restore_minutes
    rows = [
        ("provisioning replacement", before.provisioning, after.provisioning),
        ("restarting the job", before.restarting, after.restarting),
        ("restoring from checkpoint", before.restoring, after.restoring),
        ("recomputing since checkpoint", before.recomputing, after.recomputing),
        ("live migration", before.migrating, after.migrating),
    ]
    w = 30
    lines = [
        f"Cost of failures per month ({i.currency}), {i.gpus:,} GPUs at {i.gpu_hour_price} "
        f"{i.currency}/GPU-hour",
        "",
        f"{'':<{w}}{'without TorchPass':>20}{'with TorchPass':>20}",
    ]
    lines += [f"{name:<{w}}{_m(b):>20}{_m(a):>20}" for name, b, a in rows]
    lines.append(f"{'total per month':<{w}}{_m(before.total):>20}{_m(after.total):>20}")
    share = result.savings.amount / before.total.amount * 100 if before.total.amount else Decimal(0)
    lines.append(f"{'savings per month':<{w}}{'':>20}{_m(result.savings):>20}  ({share:.1f}%)")
    source = f", measured on contract {contract}" if contract else ""
    lines += [
        "",
        "Assumptions:",
        f"  month = {result.hours_per_month} h; mean time to failure {i.mttf_hours} h "
        f"-> {result.failures_per_month:.2f} failures/month",
        f"  each failure idles all GPUs {i.replace_minutes} min replace + {i.restart_minutes} min "
        f"restart + {i.restore_minutes} min restore = {idle} min,",
        f"  and recomputes half the {i.checkpoint_interval_hours} h checkpoint interval: "
        f"{_m(result.per_failure)} {i.currency} per failure",
        f"  with TorchPass: {i.success_rate * 100:.1f}% of failures live-migrate, pausing the job "
        f"{i.migration_seconds} s{source};",
        "  the rest fall back to the four costs",
    ]
    return "\n".join(lines)


def run_with_contract(args: argparse.Namespace, settings: Any) -> int:
    """`torchpass cost`; with --contract, measured on the contract's ledger alone: the counted rows
    of its current trailing window, with the recovery times the ledger keeps (no incident workflow
    is read: Temporal's retention may have deleted them)."""
    from torchpass.cli.contract import contract_ledger_rows
    from workers import contract_client

    if args.contract is not None and args.customer is None:
        raise CliError("--contract needs --customer")

    async def lookup(contract_id: str) -> list[LedgerRow]:
        try:
            return await contract_ledger_rows(await connect(settings), args.customer, contract_id)
        except contract_client.ContractClientError as e:
            raise CliError(f"contract {contract_id} of {args.customer}: {e}") from None

    return run(args, ledger_for_contract=lookup)
