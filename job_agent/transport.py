"""Streams a rank's state from a healthy donor to the ranks that need it, over authenticated sockets.

Point to point, tensor by tensor, straight into the receiver's own pre-allocated memory: no packing, no
pickling (both measured several times slower on loopback). Both sides hash the bytes they
hold, in a second thread while the socket is busy, and the receiver refuses a state whose digest differs.
"""

from __future__ import annotations

import hashlib
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta

import torch

from job_agent import wire
from job_agent.protocol import AuthError, ProtocolError, authenticate_server, connect, recv_frame, send_frame
from job_agent.state import Snapshot, StateMismatch, TrackedState, byte_view

AUTH_TIMEOUT = timedelta(seconds=2)  # a receiver proves the secret in milliseconds
MAX_STRAYS = 64
_STOP_POLL = 0.1
_SOCK_BUF = 8 * 2**20
_CHUNK = 4 * 2**20


class TransferError(Exception):
    """The transfer broke off or its digest did not match; the receiver's state is not usable."""


@dataclass(frozen=True)
class TransferStats:
    digest: str  # over the bytes as they arrived (and the header), equal to the donor's when intact
    nbytes: int
    seconds: float
    step: int


Progress = Callable[[int], None]
"""Called with the bytes streamed so far."""


class _Hasher:
    """sha256 fed from a queue in a background thread (hashlib releases the GIL on large buffers)."""

    def __init__(self, head: bytes) -> None:
        self._h = hashlib.sha256(head)
        self._q: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()
        self._t = threading.Thread(target=self._run, name="torchpass-hash", daemon=True)
        self._t.start()

    def _run(self) -> None:
        while (chunk := self._q.get()) is not None:
            self._h.update(chunk)

    def feed(self, chunk: memoryview) -> None:
        self._q.put(chunk)

    def hexdigest(self) -> str:
        self._q.put(None)
        self._t.join()
        return self._h.hexdigest()


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCK_BUF)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCK_BUF)


class StateServer:
    """The donor's side: listens on an ephemeral port and serves one snapshot to N receivers."""

    def __init__(self, secret: bytes, host: str) -> None:
        self._secret = secret
        self._listener = socket.create_server((host, 0))
        _tune(self._listener)
        self.port: int = self._listener.getsockname()[1]
        self.stream_seconds = 0.0  # bytes on the wire only: no snapshot, no waiting for the digest
        self.bytes_sent = 0

    def serve(
        self,
        snap: Snapshot,
        receivers: int,
        timeout: timedelta,
        on_progress: Progress,
        stop: Callable[[], bool] = lambda: False,
    ) -> str:
        """Send `snap` to `receivers` authenticated peers within `timeout`; returns the donor's digest.

        A connection that fails or stalls before it proves the job's secret (a port scanner, a
        connect-then-close, garbage bytes, a silent peer) is dropped after at most `AUTH_TIMEOUT` and the
        transfer goes on; more than `MAX_STRAYS` of them fail it. `stop()` is asked between connections
        (at least every `_STOP_POLL` seconds): true, the serving is called off."""
        digest: str | None = None
        deadline = time.monotonic() + timeout.total_seconds()
        strays = 0
        try:
            served = 0
            while served < receivers:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferError(f"{receivers - served} receiver(s) never came")
                if stop():
                    raise TransferError("called off by the coordinator")
                self._listener.settimeout(min(left, _STOP_POLL))
                try:
                    conn, _addr = self._listener.accept()
                except TimeoutError:
                    continue
                with conn:
                    conn.settimeout(AUTH_TIMEOUT.total_seconds())
                    try:
                        _tune(conn)
                        authenticate_server(conn, self._secret)
                    except (AuthError, OSError, ConnectionError, ProtocolError):
                        # Not a peer of this job: it gets nothing, the real receivers still do.
                        strays += 1
                        if strays > MAX_STRAYS:
                            raise TransferError(
                                f"{strays} connections failed before authenticating"
                            ) from None
                        continue
                    conn.settimeout(timeout.total_seconds())
                    digest = self._send(conn, snap, digest, on_progress)
                    served += 1
        except (OSError, ConnectionError, ProtocolError) as e:
            raise TransferError(f"serving state failed: {e}") from e
        finally:
            self._listener.close()
        return digest or snap.digest()

    def _send(self, conn: socket.socket, snap: Snapshot, digest: str | None, on_progress: Progress) -> str:
        send_frame(conn, wire.StateHeader(header=snap.header, manifest=snap.manifest()))
        # Hash while sending, once: the snapshot is frozen for every receiver.
        hasher = _Hasher(snap.header_bytes()) if digest is None else None
        t0 = time.perf_counter()
        for chunk in snap.host_chunks():
            if hasher is not None:
                hasher.feed(chunk)
            conn.sendall(chunk)
            self.bytes_sent += len(chunk)
            on_progress(self.bytes_sent)
        self.stream_seconds += time.perf_counter() - t0
        if hasher is not None:
            digest = hasher.hexdigest()
        assert digest is not None
        send_frame(conn, wire.StateEnd(digest=digest))
        if not isinstance(recv_frame(conn), wire.StateAck):
            raise TransferError("receiver did not confirm the state")
        return digest


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    n = len(view)
    while got < n:
        k = sock.recv_into(view[got : got + _CHUNK])
        if k == 0:
            raise ConnectionError("donor closed the connection mid-transfer")
        got += k


def receive_state(
    tracked: TrackedState,
    host: str,
    port: int,
    secret: bytes,
    timeout: timedelta,
    on_progress: Progress = lambda n: None,
) -> TransferStats:
    """Receive a donor's state into `tracked`, verify its digest and install it."""
    t0 = time.perf_counter()
    try:
        sock = connect(host, port, secret, timeout)
    except (OSError, ProtocolError) as e:
        raise TransferError(f"cannot reach donor at {host}:{port}: {e}") from e
    with sock:
        sock.settimeout(timeout.total_seconds())
        _tune(sock)
        try:
            first = recv_frame(sock)
            if not isinstance(first, wire.StateHeader):
                raise ProtocolError(f"expected the state header, got {first.t!r}")
            header, manifest = first.header, first.manifest
            targets = tracked.receive_targets(manifest)
            snap = Snapshot(header, [(e.path, t) for e, t in zip(manifest, targets, strict=True)])
            hasher = _Hasher(snap.header_bytes())
            staged = _receive_tensors(sock, targets, hasher, on_progress)
            digest = hasher.hexdigest()
            end = recv_frame(sock)
        except (OSError, ConnectionError, ProtocolError, StateMismatch) as e:
            raise TransferError(f"receiving state failed: {e}") from e
        if not isinstance(end, wire.StateEnd) or end.digest != digest:
            donor = end.digest if isinstance(end, wire.StateEnd) else f"no digest ({end.t})"
            raise TransferError(f"digest mismatch: donor {donor}, received {digest}")
        try:
            step = tracked.load(header, {e.path: t for e, t in zip(manifest, staged, strict=True)})
        except StateMismatch as e:
            raise TransferError(str(e)) from e
        send_frame(sock, wire.StateAck())
    return TransferStats(digest=digest, nbytes=snap.nbytes, seconds=time.perf_counter() - t0, step=step)


def _receive_tensors(
    sock: socket.socket, targets: Iterable[torch.Tensor], hasher: _Hasher, on_progress: Progress
) -> list[torch.Tensor]:
    out = []
    got = 0
    for t in targets:
        # CPU tensors are filled in place; device tensors through a host buffer, copied up after.
        host = t if t.device.type == "cpu" and t.is_contiguous() else torch.empty_like(t, device="cpu")
        view = byte_view(host)
        _recv_into(sock, view)
        hasher.feed(view)
        if host is not t:
            t.copy_(host)
        out.append(t)
        got += len(view)
        on_progress(got)
    return out
