"""`torchpass server` (the embedded Temporal dev server) and `torchpass worker` (the control
worker)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from torchpass.cli.common import connect, temporal_args


def register(sub: Any) -> None:
    s = sub.add_parser("server", help="run the embedded Temporal dev server with the web UI")
    s.add_argument("--ip", default="127.0.0.1")
    s.add_argument("--port", type=int, default=7233)
    s.add_argument("--ui-port", type=int, default=None, help="web UI port (default port + 1000)")
    s.add_argument(
        "--db-file", type=Path, default=None, help="SQLite file: incidents survive a restart"
    )
    w = sub.add_parser("worker", help="run the control worker (workflows + cluster activities)")
    temporal_args(w)


def server(args: argparse.Namespace) -> int:
    from workers.server import dev_server_command

    cmd = dev_server_command(args.ip, args.port, args.ui_port, args.db_file)
    # Become the server: SIGTERM from a supervisor reaches it and nothing is left orphaned.
    os.execv(cmd[0], cmd)


async def worker(settings: Any) -> int:
    from workers.control import control_worker

    client = await connect(settings, traced=True)
    w = control_worker(client, settings)
    print(f"torchpass control worker on {client.service_client.config.target_host}", flush=True)
    if not settings.billing.configured:
        # Not fatal (a contract may never owe a credit), but nobody should find out months later.
        print(
            "torchpass: warning: no billing destination (TORCHPASS_BILLING_WEBHOOK_URL and/or "
            "TORCHPASS_BILLING_WORKFLOW_ID): YOCO credits stay pending on their contracts until "
            "one is set",
            file=sys.stderr,
            flush=True,
        )
    await w.run()
    return 0
