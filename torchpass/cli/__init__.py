"""`torchpass`: server, worker, run, node, detect, inject, drain, jobs, incidents, contract, audit,
cost.

Each command lives in its own module of this package; they share `torchpass.cli.common` and never
import this one. Heavy imports (torch, the workers) happen inside the command that needs them, so
`torchpass --help` and argument errors answer at once.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from pydantic import ValidationError

from torchpass.cli import audit, contract, cost, detect, incidents, job, node, run, serve
from torchpass.cli.common import EXIT_USAGE, CliError, fields, load_settings, temporal_args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="torchpass", description="Live migration for distributed PyTorch training."
    )
    sub = p.add_subparsers(dest="command", required=True)
    serve.register(sub)
    run.register(sub)
    job.register(sub)
    node.register(sub)
    detect.register(sub)
    contract.register(sub, temporal_args)
    audit.register(sub, temporal_args)
    c = cost.register(sub)
    c.add_argument("--customer", help="customer of --contract")
    temporal_args(c)
    incidents.register(sub)
    return p


def entry() -> None:
    """The `torchpass` command (and `python -m torchpass.cli`)."""
    from workers.temporal import exit_process

    exit_process(main)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _dispatch(args)
    except CliError as e:
        print(f"torchpass: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except ValidationError as e:
        print(f"torchpass: invalid arguments:\n{fields(e)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "server":
        return serve.server(args)
    if args.command == "node":
        return node.run(args)
    settings = load_settings(args)
    if args.command == "worker":
        return asyncio.run(serve.worker(settings))
    if args.command == "detect":
        return detect.run(args, settings)
    if args.command == "run":
        return asyncio.run(run.run(args, settings))
    if args.command in job.COMMANDS:
        return job.run_command(args, settings)
    if args.command == "contract":
        return asyncio.run(contract.run(args, settings))
    if args.command == "audit":
        return asyncio.run(audit.run(args, settings))
    if args.command == "cost":
        return cost.run_with_contract(args, settings)
    return asyncio.run(incidents.incidents(args, settings))


if __name__ == "__main__":
    entry()
