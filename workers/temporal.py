"""One way to connect to Temporal, shared by every process and the CLI.

The settings refuse, at start-up, what would connect less safely than it looks: a client
certificate without its key (or a key without its certificate), a TLS file that is not there, an
API key or client key in a file other users can read (`ExposedKeyFile`), and plaintext to a server
off this host unless it is asked for (`allow_plaintext`). The API key is never a command-line flag
(every user of the host could read it in `ps`): it comes from TORCHPASS_TEMPORAL_API_KEY or a file.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import os
import socket
import stat
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from temporalio.client import Client, Interceptor, TLSConfig
from temporalio.contrib.pydantic import pydantic_data_converter


class ExposedKeyFile(ValueError):
    """A file holding a secret (the API key, the client's private key) that users other than its
    owner can read or write."""


class TemporalSettings(BaseSettings):
    """TORCHPASS_TEMPORAL_* variables or CLI flags; validated once at start-up."""

    model_config = SettingsConfigDict(env_prefix="TORCHPASS_TEMPORAL_", extra="ignore")

    address: str = "127.0.0.1:7233"
    namespace: str = "default"
    api_key: SecretStr | None = Field(
        default=None, description="Temporal Cloud API key; implies TLS"
    )
    api_key_file: Path | None = Field(default=None, description="a file holding the API key")
    tls: bool = False
    tls_cert: Path | None = Field(default=None, description="client certificate (PEM) for mTLS")
    tls_key: Path | None = Field(default=None, description="its private key (PEM)")
    tls_ca: Path | None = Field(default=None, description="the server's CA certificate (PEM)")
    allow_plaintext: bool = Field(
        default=False,
        description="connect without TLS to a server off this host (never to Temporal Cloud)",
    )

    @model_validator(mode="after")
    def _safe(self) -> TemporalSettings:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: a client certificate needs its key")
        for name in ("tls_cert", "tls_key", "tls_ca", "api_key_file"):
            path = getattr(self, name)
            if path is not None and not path.is_file():
                raise ValueError(f"{name}: no such file: {path}")
        for name in ("tls_key", "api_key_file"):
            path = getattr(self, name)
            if path is not None:
                owner_only(name, path)
        if self.api_key is not None and self.api_key_file is not None:
            raise ValueError("api_key and api_key_file: give one")
        if not self.encrypted and not self.allow_plaintext and not _on_this_host(self.address):
            raise ValueError(
                f"plaintext connection to {self.address}, off this host: pass --tls (or a "
                "certificate, or an API key), or --allow-plaintext to accept that anyone on the "
                "path can read and forge it"
            )
        return self

    @property
    def encrypted(self) -> bool:
        keyed = self.api_key is not None or self.api_key_file is not None
        return self.tls or keyed or self.tls_cert is not None or self.tls_ca is not None

    def key(self) -> str | None:
        if self.api_key_file is not None:
            return self.api_key_file.read_text().strip()
        return self.api_key.get_secret_value() if self.api_key is not None else None


def owner_only(name: str, path: Path) -> None:
    """`ExposedKeyFile` if users other than its owner can read or write the secret at `path`."""
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise ExposedKeyFile(
            f"{name}: {path} is open to other users of this host (mode {mode:04o}); make it its "
            f"owner's alone: chmod 600 {path}"
        )


def _on_this_host(address: str) -> bool:
    """Whether `address` (host:port) is this host's loopback, however it is spelled: 127/8 in any
    form `inet_aton` reads (127.1, 0x7f.1), ::1 in any form, bracketed or not, an IPv4-mapped
    loopback, and `localhost` in any case, with or without its trailing dot. A name is never looked
    up: another name that resolves to loopback (or could, when asked again) is off this host."""
    host = _host_of(address)
    if host.lower().removesuffix(".") == "localhost":
        return True
    ip = _ip(host)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip is not None and ip.is_loopback


def _host_of(address: str) -> str:
    """The host of `address`: "[::1]:7233" -> "::1", "127.1:7233" -> "127.1"; an IPv6 address
    without a port or brackets is all host."""
    bare = address.strip()
    if bare.startswith("[") and "]" in bare:
        return bare[1 : bare.index("]")]
    if _ip(bare) is not None:
        return bare
    return bare.rsplit(":", 1)[0]


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    if not host or host.strip(_CLASSIC):
        return None  # inet_aton reads "127.0.0.1 anything" as 127.0.0.1
    try:  # the classic IPv4 spellings: 127.1, 0x7f.0.0.1, 2130706433
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except OSError:
        return None


_CLASSIC = "0123456789abcdefABCDEFxX."


async def connect(settings: TemporalSettings, interceptors: Sequence[Interceptor] = ()) -> Client:
    """A client for `settings`; its `interceptors` (e.g. `workers.telemetry.interceptors`) apply to
    every call it makes and to every worker built from it."""
    key = settings.key()
    tls: TLSConfig | bool = settings.tls or key is not None
    if settings.tls_cert or settings.tls_ca:
        tls = TLSConfig(
            client_cert=_read(settings.tls_cert),
            client_private_key=_read(settings.tls_key),
            server_root_ca_cert=_read(settings.tls_ca),
        )
    return await Client.connect(
        settings.address,
        namespace=settings.namespace,
        api_key=key,
        tls=tls,
        data_converter=pydantic_data_converter,
        interceptors=interceptors,
    )


def _read(path: Path | None) -> bytes | None:
    return None if path is None else path.read_bytes()


def exit_process(main: Callable[[], int | None]) -> None:
    """Run a command's `main` and end the process with its exit code, without finalizing the
    interpreter.

    The Temporal SDK's core threads can call into Python while the interpreter finalizes
    (temporalio/sdk-python#300): a short-lived client then aborts at exit with `Fatal Python error:
    PyGILState_Release` and exit code 134 after its work is done (2 of 30 `torchpass incidents list`
    runs here). So the exit handlers run and the output is flushed, and the process ends there.
    """
    try:
        code = main()
    except SystemExit as e:  # argparse's --help and usage errors, a command's own sys.exit
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        code = 1 if isinstance(e.code, str) else e.code
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        # a closed pipe (`| head`) or a closed stream
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code or 0)
