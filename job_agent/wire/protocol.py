"""The authenticated transport between coordinator, ranks, spares and state-transfer peers.

Frames are a 4-byte big-endian length and a JSON object, one of the models in `job_agent.wire`. A
connection starts with a mutual HMAC-SHA256 challenge: each side proves it holds the job's secret
without sending it, so a stray process, another job's rank or a port scanner is refused before it
can send a command or read a byte of model state. Every frame after it carries an HMAC-SHA256 tag
under a key of that connection (derived from the secret and both nonces) over its direction, its
sequence number and its bytes: a frame altered, injected, replayed, reordered or taken from another
connection fails its tag and ends the connection. The raw state stream of a transfer is covered by
its digest, which travels in a tagged frame (`StateEnd`).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import threading
import weakref
from dataclasses import dataclass, field
from datetime import timedelta

from job_agent import wire

# The exit code of a rank or node agent that stopped because its coordinator was gone for good.
EXIT_COORDINATOR_LOST = 70
_LEN = struct.Struct(">I")
MAX_FRAME = 16 * 2**20
_NONCE_BYTES = 16
_MAC_BYTES = 32


class ProtocolError(Exception):
    """The peer broke the protocol: a malformed or unknown frame, an oversized message."""


class AuthError(ProtocolError):
    """The peer does not hold the job's secret, or a frame failed its tag."""


@dataclass
class _Session:
    """One authenticated connection's frame key and counters, one per direction."""

    key: bytes
    send_label: bytes
    recv_label: bytes
    sent: int = 0
    received: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def tag(self, label: bytes, seq: int, body: bytes) -> bytes:
        return hmac.new(self.key, label + seq.to_bytes(8, "big") + body, hashlib.sha256).digest()


# Sockets cannot carry attributes; the session of each authenticated one lives here, and goes with
# it.
_sessions: weakref.WeakKeyDictionary[socket.socket, _Session] = weakref.WeakKeyDictionary()


def send_frame(sock: socket.socket, frame: wire.Frame) -> None:
    send_body(sock, wire.encode(frame))


def send_body(sock: socket.socket, body: bytes) -> None:
    """One frame's bytes, tagged once the connection is authenticated."""
    session = _sessions.get(sock)
    if session is None:  # before the handshake (or a test's bare socket): framing only
        sock.sendall(_LEN.pack(len(body)) + body)
        return
    with session.lock:  # the tag's sequence number is the order on the wire
        tag = session.tag(session.send_label, session.sent, body)
        session.sent += 1
        sock.sendall(_LEN.pack(len(body)) + body + tag)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k
    return bytes(buf)


def recv_body(sock: socket.socket) -> bytes:
    """One frame's bytes, not yet decoded (the coordinator answers a bad one instead of hanging
    up)."""
    (n,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    if n > MAX_FRAME:
        raise ProtocolError(f"frame of {n} bytes exceeds the {MAX_FRAME}-byte limit")
    body = recv_exact(sock, n)
    session = _sessions.get(sock)
    if session is not None:
        tag = recv_exact(sock, _MAC_BYTES)
        seq = session.received
        session.received += 1
        if not hmac.compare_digest(tag, session.tag(session.recv_label, seq, body)):
            raise AuthError(
                f"frame {seq} failed its tag: altered, injected, replayed or out of order"
            )
    return body


def recv_frame(sock: socket.socket) -> wire.Frame:
    try:
        return wire.decode(recv_body(sock))
    except wire.BadFrame as e:
        raise ProtocolError(str(e)) from None


def _mac(secret: bytes, label: bytes, *nonces: bytes) -> bytes:
    return hmac.new(secret, label + b"".join(nonces), hashlib.sha256).digest()


def authenticate_client(sock: socket.socket, secret: bytes) -> None:
    """Client side of the mutual challenge. Raises AuthError if the server cannot prove the
    secret."""
    server_nonce = recv_exact(sock, _NONCE_BYTES)
    client_nonce = os.urandom(_NONCE_BYTES)
    sock.sendall(client_nonce + _mac(secret, b"client", server_nonce, client_nonce))
    proof = recv_exact(sock, _MAC_BYTES)
    if not hmac.compare_digest(proof, _mac(secret, b"server", client_nonce, server_nonce)):
        raise AuthError("server failed to prove the job secret")
    _sessions[sock] = _Session(_mac(secret, b"session", server_nonce, client_nonce), b"c2s", b"s2c")


# What the server reads of a client's handshake: its nonce and its proof.
CLIENT_REPLY_BYTES = _NONCE_BYTES + _MAC_BYTES


def server_challenge() -> bytes:
    """The server's nonce, the first bytes of a handshake."""
    return os.urandom(_NONCE_BYTES)


def finish_server(sock: socket.socket, secret: bytes, server_nonce: bytes, reply: bytes) -> None:
    """The rest of the server's side, once the client's reply (`CLIENT_REPLY_BYTES`) is in: check
    its proof, prove the secret back, and tag every frame of the connection from now on. Raises
    AuthError if the client cannot prove the secret."""
    client_nonce, mac = reply[:_NONCE_BYTES], reply[_NONCE_BYTES:]
    if not hmac.compare_digest(mac, _mac(secret, b"client", server_nonce, client_nonce)):
        raise AuthError("peer does not hold the job secret")
    sock.sendall(_mac(secret, b"server", client_nonce, server_nonce))
    _sessions[sock] = _Session(_mac(secret, b"session", server_nonce, client_nonce), b"s2c", b"c2s")


def authenticate_server(sock: socket.socket, secret: bytes) -> None:
    """Server side of the mutual challenge, blocking. Raises AuthError if the client cannot prove
    the secret."""
    server_nonce = server_challenge()
    sock.sendall(server_nonce)
    finish_server(sock, secret, server_nonce, recv_exact(sock, CLIENT_REPLY_BYTES))


def connect(host: str, port: int, secret: bytes, timeout: timedelta) -> socket.socket:
    """Open an authenticated connection within `timeout`; the returned socket blocks with no
    timeout."""
    sock = socket.create_connection((host, port), timeout=timeout.total_seconds())
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        authenticate_client(sock, secret)
    except BaseException:
        sock.close()
        raise
    sock.settimeout(None)
    return sock
