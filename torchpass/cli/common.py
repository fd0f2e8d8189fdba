"""What every `torchpass` command shares: its typed error, the Temporal flags, settings and a
client."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from pydantic import ValidationError

EXIT_USAGE = 2
EXIT_JOB_FAILED = 1
_TEMPORAL_FLAGS = (
    "address",
    "namespace",
    "api_key_file",
    "tls",
    "tls_cert",
    "tls_key",
    "tls_ca",
    "allow_plaintext",
)


class CliError(Exception):
    """A clear message for the user; the process exits 2 without a traceback."""


def temporal_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("temporal connection (also TORCHPASS_TEMPORAL_* variables)")
    g.add_argument("--address", help="host:port of the Temporal frontend (default 127.0.0.1:7233)")
    g.add_argument("--namespace", help="Temporal namespace (default 'default')")
    g.add_argument("--api-key-file", help="a file holding the Temporal Cloud API key (implies TLS)")
    g.add_argument("--api-key", help=argparse.SUPPRESS)  # refused: see load_settings
    g.add_argument("--tls", action="store_true", default=None, help="connect with TLS")
    g.add_argument("--tls-cert", help="client certificate (PEM) for mTLS, with --tls-key")
    g.add_argument("--tls-key", help="client key (PEM) for mTLS, with --tls-cert")
    g.add_argument("--tls-ca", help="server CA certificate (PEM)")
    g.add_argument(
        "--allow-plaintext",
        action="store_true",
        default=None,
        help="connect without TLS to a Temporal server off this host",
    )


def load_settings(args: argparse.Namespace) -> Any:
    """The process's one settings object: the environment, with the command line's Temporal flags on
    top."""
    from workers.settings import Settings

    if getattr(args, "api_key", None) is not None:
        raise CliError(
            "--api-key would show the key to every user of this host (ps): set "
            "TORCHPASS_TEMPORAL_API_KEY or pass --api-key-file"
        )
    given = {k: getattr(args, k) for k in _TEMPORAL_FLAGS if getattr(args, k, None) is not None}
    return Settings.load(temporal=given)


async def connect(settings: Any, traced: bool = False) -> Any:
    """A Temporal client for `settings`; `traced` adds the OpenTelemetry interceptor
    (TORCHPASS_OTEL_*)."""
    from workers.telemetry import interceptors
    from workers.temporal import connect as temporal_connect

    ts = settings.temporal
    chain = interceptors(settings.telemetry) if traced else []
    try:
        return await asyncio.wait_for(temporal_connect(ts, chain), 15)
    except (RuntimeError, TimeoutError) as e:
        raise CliError(
            f"cannot reach Temporal at {ts.address} (namespace {ts.namespace}): {e}\n"
            "start one with `torchpass server`, or pass --address"
        ) from None


def fields(e: ValidationError) -> str:
    """One line per rejected field, in the user's words rather than pydantic's dump."""
    lines = []
    for err in e.errors():
        where = ".".join(str(p) for p in err["loc"]) or "value"
        lines.append(f"  {where}: {err['msg']} (got {err.get('input')!r})")
    return "\n".join(lines)
