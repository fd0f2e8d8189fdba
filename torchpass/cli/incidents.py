"""`torchpass incidents list|show`: incidents as an SRE finds them, through Temporal visibility."""

from __future__ import annotations

import argparse
import json
from typing import Any

from temporalio.client import WorkflowExecutionStatus, WorkflowQueryFailedError
from temporalio.service import RPCError

from torchpass.cli.common import CliError, connect, temporal_args
from torchpass.ids import SA_JOB_ID, SA_KIND, SA_OUTCOME, IncidentMessage
from torchpass.incident.outcome import MigrationOutcome
from torchpass.render import format_outcome


def register(sub: Any) -> None:
    inc = sub.add_parser("incidents", help="find and inspect incidents (Temporal visibility)")
    isub = inc.add_subparsers(dest="incidents_command", required=True)
    il = isub.add_parser("list")
    il.add_argument("--job", default=None)
    il.add_argument("--kind", default=None)
    il.add_argument("--outcome", default=None, help="running, migrated, fallback_restart, failed")
    il.add_argument("--limit", type=int, default=50)
    il.add_argument("--json", action="store_true")
    temporal_args(il)
    ish = isub.add_parser("show")
    ish.add_argument("incident", help="workflow id (as listed)")
    ish.add_argument("--json", action="store_true")
    temporal_args(ish)


def _query(args: argparse.Namespace) -> str:
    parts = ["WorkflowType = 'MigrationWorkflow'"]
    for attr, value in ((SA_JOB_ID, args.job), (SA_KIND, args.kind), (SA_OUTCOME, args.outcome)):
        if value is not None:
            if "'" in value:
                raise ValueError(f"invalid filter value {value!r}")
            parts.append(f"{attr} = '{value}'")
    return " AND ".join(parts)


async def incidents(args: argparse.Namespace, settings: Any) -> int:
    client = await connect(settings)
    if args.incidents_command == "list":
        rows = []
        async for wf in client.list_workflows(_query(args), limit=args.limit):
            sa = wf.search_attributes
            rows.append(
                {
                    "incident": wf.id,
                    "job": (sa.get(SA_JOB_ID) or [""])[0],
                    "kind": (sa.get(SA_KIND) or [""])[0],
                    "outcome": (sa.get(SA_OUTCOME) or [""])[0],
                    "status": wf.status.name if wf.status else "",
                    "started": wf.start_time.isoformat(timespec="seconds"),
                }
            )
        if args.json:
            print(json.dumps(rows, indent=2))
        else:
            print(f"{'INCIDENT':<64} {'KIND':<16} {'OUTCOME':<17} STARTED")
            for r in rows:
                print(f"{r['incident']:<64} {r['kind']:<16} {r['outcome']:<17} {r['started']}")
        return 0
    # As listed (the workflow id) or as `torchpass run` and the outcome print it (workflow id/run
    # id).
    workflow_id, _, run_id = args.incident.partition("/")
    handle = client.get_workflow_handle(workflow_id, run_id=run_id or None)
    try:
        desc = await handle.describe()
    except RPCError as e:
        raise CliError(f"no incident {args.incident!r}: {e.message}") from None
    if desc.status == WorkflowExecutionStatus.COMPLETED:
        recorded = await handle.result()
    else:  # running; or recorded and open a while for late evidence (`outcome` answers then)
        recorded = await _recorded(handle)
        if recorded is None:
            status = await handle.query(IncidentMessage.STATUS)
            print(
                json.dumps(
                    status if isinstance(status, dict) else status.model_dump(mode="json"), indent=2
                )
            )
            return 0
    outcome = MigrationOutcome.model_validate(recorded)
    print(outcome.model_dump_json(indent=2) if args.json else format_outcome(outcome))
    return 0


async def _recorded(handle: Any) -> Any:
    """The outcome a running incident recorded already, None if none yet (or a run too old to
    say)."""
    try:
        return await handle.query(IncidentMessage.OUTCOME)
    except WorkflowQueryFailedError:
        return None
