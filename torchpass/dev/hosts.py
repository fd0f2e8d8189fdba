"""Several hosts on one machine, for the demo and the multi-node tests.

Where network namespaces can be made (root on Linux), each host is a namespace of its own with one
address, and every host and the coordinator's end sit on one bridge in a namespace of the fixture's
own: a real L2 segment, real routing, a host reachable only at its address. The addresses come from
198.18.0.0/15 (set aside for benchmarking networks, never routed), one /24 per fixture. Everything
is created with names unique to the fixture and deleted at its end, also when a test fails; no
interface the fixture did not create is touched.

Where namespaces cannot be made, each host is one loopback address (127.0.0.2, 127.0.0.3, ...): that
still catches an address hard-coded to 127.0.0.1 or a listener on the wrong one, but not routing.
`Fabric.mode` says which, and the tests print it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Host:
    name: str
    address: str
    netns: str | None = None

    @property
    def prefix(self) -> tuple[str, ...]:
        """What runs a command on this host."""
        return ("ip", "netns", "exec", self.netns) if self.netns else ()

    def command(self, argv: Sequence[str]) -> list[str]:
        return [*self.prefix, *argv]


@dataclass
class Fabric:
    mode: str  # "netns" or "loopback"
    coordinator: str  # the address the job's coordinator listens on
    hosts: list[Host]
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self, host: Host, argv: Sequence[str], log: str) -> subprocess.Popen[bytes]:
        """A process on `host`, in its own session (stopped with all its children at the end)."""
        with open(log, "wb") as out:
            p = subprocess.Popen(
                host.command(argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs.append(p)
        return p

    def stop(self, p: subprocess.Popen[bytes], sig: signal.Signals = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, sig)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def _remove(namespaces: list[str]) -> None:
    """Deleting a namespace deletes the veth ends in it, and so their peers outside it."""
    for ns in reversed(namespaces):
        subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True, timeout=10)
    namespaces.clear()


@contextlib.contextmanager
def fabric(n: int) -> Iterator[Fabric]:
    """`n` hosts and an address for the coordinator: namespaces on a bridge, else loopback
    addresses."""
    tag = "tp" + secrets.token_hex(3)  # interface names stay under 15 characters
    made: list[str] = []
    f: Fabric | None = None
    try:
        if shutil.which("ip") is None or os.geteuid() != 0:
            raise PermissionError("no ip command, or not root")
        net = f"198.18.{secrets.randbelow(250) + 1}"
        bridge = f"{tag}br"
        _ip("netns", "add", bridge)
        made.append(bridge)
        _ip("-n", bridge, "link", "add", "br0", "type", "bridge")
        _ip("-n", bridge, "link", "set", "br0", "up")

        def wire(end: str, netns: str | None, address: str) -> None:
            _ip("link", "add", end, "type", "veth", "peer", "name", f"{end}p")
            _ip("link", "set", f"{end}p", "netns", bridge)
            _ip("-n", bridge, "link", "set", f"{end}p", "master", "br0", "up")
            where = ("-n", netns) if netns else ()
            if netns:
                _ip("link", "set", end, "netns", netns)
                _ip(*where, "link", "set", "lo", "up")
            _ip(*where, "addr", "add", f"{address}/24", "dev", end)
            _ip(*where, "link", "set", end, "up")

        wire(f"{tag}c", None, f"{net}.1")  # the coordinator's host: this namespace
        hosts = []
        for i in range(n):
            ns = f"{tag}h{i}"
            _ip("netns", "add", ns)
            made.append(ns)
            wire(f"{tag}h{i}", ns, f"{net}.{10 + i}")
            hosts.append(Host(f"node{i}", f"{net}.{10 + i}", ns))
        f = Fabric("netns", f"{net}.1", hosts)
    except (OSError, subprocess.SubprocessError):
        _remove(made)
        f = Fabric(
            "loopback", "127.0.0.1", [Host(f"node{i}", f"127.0.0.{2 + i}") for i in range(n)]
        )
    try:
        yield f
    finally:
        for p in f.procs:
            f.stop(p)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)
        _remove(made)
