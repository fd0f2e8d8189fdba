"""`torchpass incidents list|show`: incidents as an SRE finds them, through Temporal visibility."""

from __future__ import annotations

import argparse
import json
from typing import Any

from temporalio.client import WorkflowExecutionStatus
from temporalio.service import RPCError

from torchpass.ids import SA_JOB_ID, SA_KIND, SA_OUTCOME
from torchpass.models import MigrationOutcome


def _query(args: argparse.Namespace) -> str:
    parts = ["WorkflowType = 'MigrationWorkflow'"]
    for attr, value in ((SA_JOB_ID, args.job), (SA_KIND, args.kind), (SA_OUTCOME, args.outcome)):
        if value is not None:
            if "'" in value:
                raise ValueError(f"invalid filter value {value!r}")
            parts.append(f"{attr} = '{value}'")
    return " AND ".join(parts)


async def incidents(args: argparse.Namespace, temporal: Any) -> int:
    from torchpass.cli import CliError
    from workers.temporal import connect

    try:
        client = await connect(temporal)
    except RuntimeError as e:
        raise CliError(f"cannot reach Temporal at {temporal.address}: {e}") from None
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
    handle = client.get_workflow_handle(args.incident)
    try:
        desc = await handle.describe()
    except RPCError as e:
        raise CliError(f"no incident {args.incident!r}: {e.message}") from None
    if desc.status != WorkflowExecutionStatus.COMPLETED:
        status = await handle.query("status")
        print(json.dumps(status if isinstance(status, dict) else status.model_dump(mode="json"), indent=2))
        return 0
    outcome = MigrationOutcome.model_validate(await handle.result())
    print(outcome.model_dump_json(indent=2) if args.json else format_outcome(outcome))
    return 0


def format_outcome(o: MigrationOutcome) -> str:
    lines = [
        f"incident   {o.incident_id}",
        f"job        {o.job_id}   domain {o.failure_domain}   lost ranks {list(o.lost_slots)}",
        f"kind       {o.kind}   ({o.evidence_count} report(s))",
        f"class      {o.classification.category} - "
        f"{'qualifying' if o.classification.qualifying else 'disqualifying'}: {o.classification.reason}",
        f"outcome    {o.disposition}   success={o.success}   steps recomputed {o.steps_recomputed}",
    ]
    if o.recovery_seconds is not None:
        lines.append(f"recovery   {o.recovery_seconds:.3f} s from failure to all ranks training again")
    for p in o.phases:
        work = f"  (in activity {p.work_seconds:.3f} s)" if p.work_seconds is not None else ""
        lines.append(f"  {p.phase:<9} {p.seconds:7.3f} s{work}")
    if o.proof is not None:
        pr = o.proof
        lines.append(
            f"proof      donor rank {pr.donor_slot} -> ranks {list(pr.receiver_slots)}, step {pr.step_before}"
            f" -> {pr.step_after}, {pr.bytes / 1e6:.1f} MB in {pr.seconds:.3f} s"
        )
        lines.append(f"           digest {pr.donor_digest[:16]}... matches on every receiver")
    if o.fallback is not None:
        lines.append(
            f"fallback   restored step {o.fallback.restored_step}, {o.fallback.steps_recomputed} recomputed"
        )
    if o.error:
        lines.append(f"error      {o.error}")
    return "\n".join(lines)
