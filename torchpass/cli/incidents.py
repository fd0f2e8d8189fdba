"""`torchpass incidents list|show`: incidents as an SRE finds them, through Temporal visibility.

A failure claim the job refuted (its outcome "not a failure": forged, or a false alarm) is no
incident: `list` leaves such claims out and says how many it left out; `list --refuted` lists them.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from temporalio.client import WorkflowExecutionStatus, WorkflowQueryFailedError
from temporalio.service import RPCError

from torchpass.cli.common import CliError, connect, temporal_args
from torchpass.ids import SA_JOB_ID, SA_KIND, SA_OUTCOME, IncidentMessage
from torchpass.incident.outcome import MigrationOutcome
from torchpass.models import Disposition
from torchpass.render import format_outcome

REFUTED = Disposition.NOT_A_FAILURE.value


def register(sub: Any) -> None:
    inc = sub.add_parser("incidents", help="find and inspect incidents (Temporal visibility)")
    isub = inc.add_subparsers(dest="incidents_command", required=True)
    il = isub.add_parser("list")
    il.add_argument("--job", default=None)
    il.add_argument("--kind", default=None)
    which = il.add_mutually_exclusive_group()
    which.add_argument(
        "--outcome",
        default=None,
        help="running, migrated, fallback_restart, failed (or not_a_failure: see --refuted)",
    )
    which.add_argument(
        "--refuted",
        action="store_true",
        help="list the failure claims the job refuted (not a failure), left out otherwise",
    )
    il.add_argument("--limit", type=int, default=50)
    il.add_argument("--json", action="store_true")
    temporal_args(il)
    ish = isub.add_parser("show")
    ish.add_argument("incident", help="workflow id (as listed)")
    ish.add_argument("--json", action="store_true")
    temporal_args(ish)


def _query(args: argparse.Namespace, refuted: bool | None = None) -> str:
    """The visibility query of `args`' filters: refuted claims only (`refuted`), or none of them
    unless an outcome is asked for (`refuted` is `args.refuted` unless given)."""
    parts = ["WorkflowType = 'MigrationWorkflow'"]
    for attr, value in ((SA_JOB_ID, args.job), (SA_KIND, args.kind), (SA_OUTCOME, args.outcome)):
        if value is not None:
            if "'" in value:
                raise ValueError(f"invalid filter value {value!r}")
            parts.append(f"{attr} = '{value}'")
    if args.outcome is None:
        if args.refuted if refuted is None else refuted:
            parts.append(f"{SA_OUTCOME} = '{REFUTED}'")
        else:  # a run that never recorded its attributes (it failed at its start) stays listed
            parts.append(f"({SA_OUTCOME} IS NULL OR {SA_OUTCOME} != '{REFUTED}')")
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
            if not args.refuted and args.outcome is None and (left := await _refuted(client, args)):
                print(f"({left} failure claim(s) the job refuted left out: --refuted lists them)")
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


async def _refuted(client: Any, args: argparse.Namespace) -> int:
    """How many refuted claims `list` left out (0 where the server cannot count)."""
    try:
        return int((await client.count_workflows(_query(args, refuted=True))).count)
    except RPCError:
        return 0


async def _recorded(handle: Any) -> Any:
    """The outcome a running incident recorded already, None if none yet (or a run too old to
    say)."""
    try:
        return await handle.query(IncidentMessage.OUTCOME)
    except WorkflowQueryFailedError:
        return None
