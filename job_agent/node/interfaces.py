"""Which network interface a node's collectives use: the one holding the address the node is reached
at (gloo and NCCL left to themselves bind what the host name resolves to, often loopback)."""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import socket
import struct


def collective_interface(host: str, environ: os._Environ[str] | dict[str, str]) -> dict[str, str]:
    """GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME for the interface holding `host`, unless already
    set.

    Left to itself, gloo binds the address the host name resolves to, often loopback: its peers on
    other hosts then never connect. The node's processes talk collectives where the node said it is
    reached."""
    name = _interface_holding(host)
    if name is None:
        return {}
    return {k: name for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if k not in environ}


def _interface_holding(host: str) -> str | None:
    try:
        wanted = ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError):
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            with contextlib.suppress(OSError):
                # SIOCGIFADDR: the interface's IPv4 address, at bytes 20-24 of the answer.
                got = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
                if ipaddress.ip_address(got[20:24]) == wanted:
                    return name
    return None
