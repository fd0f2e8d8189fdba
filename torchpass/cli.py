"""`torchpass`: server, worker, run, inject, jobs, incidents, contract, cost.

Heavy imports (torch, temporalio) happen inside the command that needs them, so `torchpass --help` and
argument errors answer at once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from torchpass.settings import CliSettings

EXIT_USAGE = 2
EXIT_JOB_FAILED = 1


class CliError(Exception):
    """A clear message for the user; the process exits 2 without a traceback."""


def _temporal_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("temporal connection (also TORCHPASS_TEMPORAL_* variables)")
    g.add_argument("--address", help="host:port of the Temporal frontend (default 127.0.0.1:7233)")
    g.add_argument("--namespace", help="Temporal namespace (default 'default')")
    g.add_argument("--api-key", help="Temporal Cloud API key (implies TLS)")
    g.add_argument("--tls", action="store_true", default=None, help="connect with TLS")
    g.add_argument("--tls-cert", help="client certificate (PEM) for mTLS")
    g.add_argument("--tls-key", help="client key (PEM) for mTLS")
    g.add_argument("--tls-ca", help="server CA certificate (PEM)")


def _job_control_parsers(sub: Any) -> None:
    """`inject` and `drain`: requests to a running job's coordinator on this host."""
    i = sub.add_parser("inject", help="inject a failure into a running job (tests, demos, chaos)")
    i.add_argument(
        "action", choices=["kill", "hang", "pause"], help="pause: SIGSTOP, SIGCONT after --seconds"
    )
    i.add_argument("--job", required=True)
    i.add_argument("--rank", type=int, required=True)
    i.add_argument("--after-step", type=int, default=None, help="wait until the rank reaches this step")
    i.add_argument("--seconds", type=float, default=5.0, help="how long a pause lasts")

    d = sub.add_parser("drain", help="planned migration: move a healthy rank off its node (cordon/drain)")
    d.add_argument("--job", required=True)
    d.add_argument("--rank", type=int, required=True)
    d.add_argument("--reason", default="operator request", help="recorded on the incident")
    d.add_argument("--cordon", action="store_true", help="report it as a node cordon rather than a drain")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="torchpass", description="Live migration for distributed PyTorch training."
    )
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("server", help="run the embedded Temporal dev server with the web UI")
    s.add_argument("--ip", default="127.0.0.1")
    s.add_argument("--port", type=int, default=7233)
    s.add_argument("--ui-port", type=int, default=None, help="web UI port (default port + 1000)")
    s.add_argument("--db-file", type=Path, default=None, help="SQLite file: incidents survive a restart")

    w = sub.add_parser("worker", help="run the control worker (workflows + cluster activities)")
    _temporal_args(w)

    r = sub.add_parser("run", help="launch a training script under the agent, like torchrun")
    r.add_argument("--nproc", type=int, default=2, help="ranks (data-parallel replicas)")
    r.add_argument("--spares", type=int, default=1, help="warm spare processes")
    r.add_argument("--job-id", default=None)
    r.add_argument("--hang-timeout", type=float, default=2.0, help="seconds without heartbeat or progress")
    r.add_argument("--collective-timeout", type=float, default=60.0, help="seconds one collective may take")
    r.add_argument("--checkpoint-every", type=int, default=50, help="steps between fallback checkpoints")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    r.add_argument("--customer", help="customer of the YOCO contract the job's incidents count toward")
    r.add_argument("--contract", help="that contract's id (with --customer)")
    r.add_argument("script", type=Path)
    r.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script (after --)")
    _temporal_args(r)

    _job_control_parsers(sub)
    sub.add_parser("jobs", help="list the jobs running on this host")

    from torchpass.contract_cli import register as register_contract
    from torchpass.cost_cli import register as register_cost

    register_contract(sub, _temporal_args)
    cost = register_cost(sub)
    cost.add_argument("--customer", help="customer of --contract")
    _temporal_args(cost)

    inc = sub.add_parser("incidents", help="find and inspect incidents (Temporal visibility)")
    isub = inc.add_subparsers(dest="incidents_command", required=True)
    il = isub.add_parser("list")
    il.add_argument("--job", default=None)
    il.add_argument("--kind", default=None)
    il.add_argument("--outcome", default=None, help="running, migrated, fallback_restart, failed")
    il.add_argument("--limit", type=int, default=50)
    il.add_argument("--json", action="store_true")
    _temporal_args(il)
    ish = isub.add_parser("show")
    ish.add_argument("incident", help="workflow id (as listed)")
    ish.add_argument("--json", action="store_true")
    _temporal_args(ish)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _dispatch(args)
    except CliError as e:
        print(f"torchpass: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except ValidationError as e:
        print(f"torchpass: invalid arguments:\n{_fields(e)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


def _fields(e: ValidationError) -> str:
    """One line per rejected field, in the user's words rather than pydantic's dump."""
    lines = []
    for err in e.errors():
        where = ".".join(str(p) for p in err["loc"]) or "value"
        lines.append(f"  {where}: {err['msg']} (got {err.get('input')!r})")
    return "\n".join(lines)


def _dispatch(args: argparse.Namespace) -> int:
    settings = CliSettings()
    if args.command == "server":
        from torchpass.server import dev_server_command

        cmd = dev_server_command(args.ip, args.port, args.ui_port, args.db_file)
        # Become the server: SIGTERM from a supervisor reaches it and nothing is left orphaned.
        os.execv(cmd[0], cmd)
    if args.command == "worker":
        return asyncio.run(_worker(args))
    if args.command == "run":
        return asyncio.run(_run(args, settings))
    if args.command == "inject":
        return _inject(args, settings)
    if args.command == "drain":
        msg = {
            "t": "drain",
            "slot": args.rank,
            "reason": args.reason,
            "kind": "cordon" if args.cordon else "drain",
        }
        reply = _request(settings, args.job, msg)
        print(f"torchpass: rank {args.rank} of job {args.job} leaves {reply['node']}: incident started")
        return 0
    if args.command == "jobs":
        from job_agent.jobs import running_jobs

        for j in running_jobs(settings.state_dir):
            print(
                f"{j['job_id']}\tworld {j['world_size']}\tcoordinator pid {j['pid']}\tsince {j['started_at']}"
            )
        return 0
    if args.command == "contract":
        return asyncio.run(_contract(args))
    if args.command == "cost":
        return _cost(args)
    from torchpass.incidents_cli import incidents

    return asyncio.run(incidents(args, _temporal_settings(args)))


def _temporal_settings(args: argparse.Namespace) -> Any:
    from workers.temporal import TemporalSettings

    given = {
        k: getattr(args, k)
        for k in ("address", "namespace", "api_key", "tls", "tls_cert", "tls_key", "tls_ca")
        if getattr(args, k, None) is not None
    }
    return TemporalSettings(**given)


async def _client(args: argparse.Namespace) -> Any:
    from workers.telemetry import TelemetrySettings, interceptors
    from workers.temporal import connect

    ts = _temporal_settings(args)
    # Incidents are traced where they run: the control worker and the job's worker (TORCHPASS_OTEL_*).
    traced = interceptors(TelemetrySettings()) if args.command in ("worker", "run") else []
    try:
        return await asyncio.wait_for(connect(ts, traced), 15)
    except (RuntimeError, TimeoutError) as e:
        raise CliError(
            f"cannot reach Temporal at {ts.address} (namespace {ts.namespace}): {e}\n"
            "start one with `torchpass server`, or pass --address"
        ) from None


async def _contract(args: argparse.Namespace) -> int:
    from torchpass.contract_cli import run

    return await run(args, await _client(args))


def _cost(args: argparse.Namespace) -> int:
    """`torchpass cost`; with --contract, measured on the contract's ledger alone: the counted rows of
    its current trailing window, with the recovery times the ledger keeps (no incident workflow is read:
    Temporal's retention may have deleted them)."""
    from torchpass import contract_client
    from torchpass.contract_cli import contract_ledger_rows
    from torchpass.contract_models import LedgerRow
    from torchpass.cost_cli import run

    if args.contract is not None and args.customer is None:
        raise CliError("--contract needs --customer")

    async def lookup(contract_id: str) -> list[LedgerRow]:
        try:
            return await contract_ledger_rows(await _client(args), args.customer, contract_id)
        except contract_client.ContractClientError as e:
            raise CliError(f"contract {contract_id} of {args.customer}: {e}") from None

    return run(args, ledger_for_contract=lookup)


async def _worker(args: argparse.Namespace) -> int:
    from torchpass.billing import BillingSettings
    from workers.control import control_worker

    client = await _client(args)
    billing = BillingSettings()
    worker = control_worker(client, billing=billing)
    print(f"torchpass control worker on {client.service_client.config.target_host}", flush=True)
    if not billing.configured:
        # Not fatal (a contract may never owe a credit), but nobody should find out months later.
        print(
            "torchpass: warning: no billing destination (TORCHPASS_BILLING_WEBHOOK_URL and/or "
            "TORCHPASS_BILLING_WORKFLOW_ID): YOCO credits stay pending on their contracts until one is set",
            file=sys.stderr,
            flush=True,
        )
    await worker.run()
    return 0


async def _run(args: argparse.Namespace, settings: CliSettings) -> int:
    from torchpass.job import JobSpec

    script_args = args.script_args[1:] if args.script_args[:1] == ["--"] else args.script_args
    spec_fields: dict[str, Any] = {
        "script": args.script,
        "args": tuple(script_args),
        "nproc": args.nproc,
        "spares": args.spares,
        "state_dir": settings.state_dir,
        "hang_timeout": args.hang_timeout,
        "collective_timeout": args.collective_timeout,
        "checkpoint_every": args.checkpoint_every,
        "seed": args.seed,
        "threads": args.threads,
    }
    if args.job_id:
        spec_fields["job_id"] = args.job_id
    if (args.customer is None) != (args.contract is None):
        raise CliError("--customer and --contract go together")
    if args.contract is not None:
        spec_fields["contract"] = {"customer_id": args.customer, "contract_id": args.contract}
    spec = JobSpec(**spec_fields)
    client = await _client(args)
    from workers.job import run_job

    print(f"torchpass: job {spec.job_id}: {spec.nproc} ranks + {spec.spares} warm spare(s)", flush=True)
    result = await run_job(spec, client)
    print(_summary(result.model_dump(mode="json")), flush=True)
    return 0 if result.ok else EXIT_JOB_FAILED


def _summary(result: dict[str, Any]) -> str:
    lines = [f"torchpass: job {result['job_id']} {result['status']} after {result['steps_completed']} steps"]
    for o in result["incidents"]:
        lines.append(
            f"  incident {o['incident_id']}: {o['kind']} -> {o['disposition']}, "
            f"recovered in {o['recovery_seconds'] or 0:.2f} s, {o['steps_recomputed']} steps recomputed"
        )
    if result["error"]:
        lines.append(f"torchpass: {result['error']}")
    return "\n".join(lines)


def _request(settings: CliSettings, job: str, msg: dict[str, Any]) -> dict[str, Any]:
    """One request to a job's coordinator on this host; an error reply is a CliError."""
    from job_agent.jobs import UnknownJob, request

    try:
        reply = request(settings.state_dir, job, msg)
    except UnknownJob as e:
        raise CliError(str(e)) from None
    except OSError as e:
        raise CliError(f"cannot reach the coordinator of job {job}: {e}") from None
    if reply.get("t") != "ok":
        raise CliError(reply.get("reason", json.dumps(reply)))
    return reply


def _drain(args: argparse.Namespace, settings: CliSettings) -> int:
    kind = "cordon" if args.cordon else "drain"
    msg = {"t": "drain", "slot": args.rank, "reason": args.reason, "kind": kind}
    reply = _request(settings, args.job, msg)
    print(f"torchpass: rank {args.rank} of job {args.job} leaves {reply['node']} ({kind}): incident started")
    return 0


def _inject(args: argparse.Namespace, settings: CliSettings) -> int:
    msg = {
        "t": "inject",
        "action": args.action,
        "slot": args.rank,
        "after_step": args.after_step,
        "seconds": args.seconds,
    }
    _request(settings, args.job, msg)
    when = f" at step {args.after_step}" if args.after_step is not None else " now"
    print(f"torchpass: {args.action} of rank {args.rank} in job {args.job} scheduled{when}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
