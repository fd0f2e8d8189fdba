"""`torchpass audit`: a contract's ledger recomputed from the incidents' and validations' own
histories and the jobs' signatures (`torchpass.contract.audit`), every disagreement printed; exit 1
if there is any. A customer or an auditor runs it with read access to the namespace."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from datetime import date
from typing import Any

from torchpass.cli.common import connect
from torchpass.ids import CONTROL_TASK_QUEUE, WorkflowName, contract_workflow_id

EXIT_DISAGREES = 1


def register(sub: Any, temporal_args: Callable[[argparse.ArgumentParser], None]) -> None:
    a = sub.add_parser(
        "audit",
        help="recompute a contract's ledger from the workflows' histories and the jobs' "
        "signatures; exit 1 on any disagreement",
    )
    a.add_argument("--customer", required=True)
    a.add_argument("--contract", required=True)
    a.add_argument(
        "--control-queue",
        default=CONTROL_TASK_QUEUE,
        help="the control worker's task queue: only validations run there count",
    )
    a.add_argument("--limit", type=int, default=10_000, help="workflow runs read, of each type")
    a.add_argument("--json", action="store_true")
    temporal_args(a)


async def run(args: argparse.Namespace, settings: Any) -> int:
    from activities.histories import HistoryReader
    from torchpass.contract.audit import Validations, audit
    from torchpass.contract.queries import LedgerRow
    from torchpass.contract.terms import ContractPurpose
    from torchpass.render import format_audit
    from workers import contract_client as cc

    client = await connect(settings)
    reader = HistoryReader(client)
    workflow_id = contract_workflow_id(args.customer, args.contract)
    standing = await cc.get_standing(client, args.customer, args.contract)
    rows: list[LedgerRow] = []
    rolled: set[date] = set()
    purpose: ContractPurpose | None = None
    offset: int | None = 0
    while offset is not None:
        page = await cc.get_ledger(client, args.customer, args.contract, offset, 1000)
        rows += page.rows
        rolled |= {r.day for r in page.rolled_up}
        purpose, offset = page.purpose, page.next_offset
    incidents = []
    async for wf in client.list_workflows(_of(WorkflowName.MIGRATION), limit=args.limit):
        facts = await reader.incident(f"{wf.id}/{wf.run_id}", workflow_id)
        incidents += [(o, facts) for o in facts.signalled]
    found = []
    async for wf in client.list_workflows(_of(WorkflowName.VALIDATION), limit=args.limit):
        vfacts = await reader.validation(f"{wf.id}/{wf.run_id}")
        found += [(r, vfacts) for r in vfacts.recorded]
    assert purpose is not None
    validations = Validations(
        found, args.contract, purpose, args.control_queue, standing.enrolment_key
    )
    result = audit(
        rows, incidents, validations, (standing.window_start, standing.window_end), rolled
    )
    agrees = not result.findings and (result.qualifying, result.successful) == (
        standing.qualifying,
        standing.successful,
    )
    if args.json:
        print(result.model_dump_json(indent=2))
    else:
        print(format_audit(result, standing.qualifying, standing.successful))
    return 0 if agrees else EXIT_DISAGREES


def _of(workflow_type: str) -> str:
    return f"WorkflowType = '{workflow_type}'"
