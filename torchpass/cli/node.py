"""`torchpass node`: the node agent of a multi-node job, one per host (`job_agent.node.agent`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def register(sub: Any) -> None:
    n = sub.add_parser(
        "node",
        help="join a multi-node job's coordinator and run this host's ranks and warm spares",
        description="Started on each host of a job run with `torchpass run --nnodes N --remote`: "
        "it joins the job's coordinator, runs the ranks and spares placed on this host (its own "
        "SCRIPT and arguments) and stops them when the job ends.",
    )
    n.add_argument("--job", required=True, help="the job id `torchpass run` printed")
    n.add_argument(
        "--coordinator",
        default=None,
        help="host:port `torchpass run` printed (default: read from the job's registration under "
        "--state-dir, a directory shared with the coordinator's host, once it is there)",
    )
    n.add_argument(
        "--secret-file",
        type=Path,
        default=None,
        help="this host's copy of the job's secret "
        "(default: the registration's, under --state-dir)",
    )
    n.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="the jobs' shared state directory (TORCHPASS_STATE_DIR)",
    )
    n.add_argument(
        "--host", required=True, help="this host's address, reachable from every other node"
    )
    n.add_argument(
        "--name", default=None, help="the node's name, unique in the job (default: hostname)"
    )
    n.add_argument("--slots", type=int, default=0, help="ranks this node runs (0: a spare node)")
    n.add_argument("--spares", type=int, default=0, help="warm spares this node keeps")
    n.add_argument(
        "--coordinator-wait",
        type=float,
        default=120.0,
        help="seconds its ranks train on without the coordinator, waiting for it to be restarted "
        "(0: stop)",
    )
    n.add_argument(
        "--gpu-check-every",
        type=float,
        default=1.0,
        help="seconds between reads of the GPUs' health through NVML (0: never; no NVML: no GPUs)",
    )
    n.add_argument(
        "--max-gpu-temperature",
        type=int,
        default=85,
        help="Celsius at which a GPU's ranks are moved off it",
    )
    n.add_argument(
        "--watch-path",
        type=Path,
        action="append",
        default=[],
        help="a filesystem the job writes to (its checkpoints), checked for room and for being "
        "mounted (repeatable); a rank failing while it is full or gone is a shared-infrastructure "
        "failure",
    )
    n.add_argument(
        "--min-free-disk",
        type=int,
        default=64 << 20,
        help="bytes under which a watched path counts as full (default 64 MiB)",
    )
    n.add_argument(
        "--min-free-memory",
        type=float,
        default=0.02,
        help="share of the host's memory available under which it counts as out of memory (default "
        "0.02)",
    )
    n.add_argument(
        "--host-check-every",
        type=float,
        default=1.0,
        help="seconds between reads of the watched paths and the host's memory (0: never)",
    )
    n.add_argument(
        "--proc",
        type=Path,
        default=Path("/proc"),
        help="the host's /proc (in a container: where mounted)",
    )
    n.add_argument("script", type=Path)
    n.add_argument(
        "script_args", nargs=argparse.REMAINDER, help="arguments for the script (after --)"
    )


def run(args: argparse.Namespace) -> int:
    from job_agent.node.agent import run_node
    from job_agent.node.settings import NodeSettings

    script_args = args.script_args[1:] if args.script_args[:1] == ["--"] else args.script_args
    if args.coordinator is None or args.secret_file is None:
        args.coordinator, args.secret_file = _registered(args)
    fields: dict[str, Any] = {
        "job_id": args.job,
        "coordinator": args.coordinator,
        "host": args.host,
        "secret_file": args.secret_file,
        "slots": args.slots,
        "spares": args.spares,
        "coordinator_wait": args.coordinator_wait,
        "gpu_check_every": args.gpu_check_every,
        "max_gpu_temperature": args.max_gpu_temperature,
        "watch_paths": tuple(args.watch_path),
        "min_free_disk": args.min_free_disk,
        "min_free_memory": args.min_free_memory,
        "host_check_every": args.host_check_every,
        "proc": args.proc,
        "script": args.script,
        "args": tuple(script_args),
    }
    if args.name:
        fields["node"] = args.name
    return run_node(NodeSettings(**fields))


def _registered(args: argparse.Namespace) -> tuple[str, Path]:
    """The coordinator's address and secret from the job's registration in the shared state
    directory, waiting for the coordinator to register (a batch script starts both at once)."""
    import json
    import os
    import time

    from torchpass.cli.common import CliError

    state = args.state_dir or Path(
        os.environ.get("TORCHPASS_STATE_DIR") or Path.home() / ".local/state/torchpass"
    )
    job_dir = state / "jobs" / args.job
    deadline = time.monotonic() + REGISTER_WAIT
    while True:
        try:
            info = json.loads((job_dir / "job.json").read_text())
            if (job_dir / "secret").exists():
                return args.coordinator or str(
                    info["coordinator"]
                ), args.secret_file or job_dir / "secret"
        except (OSError, ValueError, KeyError, TypeError):
            pass
        if time.monotonic() > deadline:
            raise CliError(
                f"job {args.job} has not registered under {state} within {REGISTER_WAIT:.0f} s"
            )
        time.sleep(0.2)


REGISTER_WAIT = 300.0
