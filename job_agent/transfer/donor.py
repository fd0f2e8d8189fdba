"""The donor's side of a state transfer: a rank's state served over authenticated sockets to the
ranks that need it, each taking the byte ranges it asks for (`job_agent.transfer.receiver` is the
receiver's side).

Straight from the tensors' own memory: no packing, no pickling (both measured several times slower
on loopback). The donor hashes its whole state once, in a second thread while the sockets are busy,
and each range as it sends it; the receiver refuses a range or a state whose digest differs.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta

from job_agent import wire
from job_agent.transfer.snapshot import Snapshot, state_hash
from job_agent.wire.protocol import (
    AuthError,
    ProtocolError,
    authenticate_server,
    recv_frame,
    send_frame,
)
from torchpass.incident.steps import Stripe

AUTH_TIMEOUT = timedelta(seconds=2)  # a receiver proves the secret in milliseconds
MAX_STRAYS = 64
_STOP_POLL = 0.1
_SOCK_BUF = 8 * 2**20
CHUNK = 4 * 2**20


class TransferError(Exception):
    """The transfer broke off or its digest did not match; the receiver's state is not usable."""


@dataclass(frozen=True)
class TransferStats:
    digest: str  # over the bytes as they arrived (and the header), equal to the donor's when intact
    nbytes: int
    seconds: float
    step: int
    stripes: tuple[Stripe, ...] = ()
    dropped: tuple[int, ...] = field(default=())  # donors the receiver stopped taking slices from


Progress = Callable[[int], None]
"""Called with the bytes streamed so far."""


class Hasher:
    """The state hash fed from a queue in a background thread (it releases the GIL on large
    buffers)."""

    def __init__(self, head: bytes = b"") -> None:
        self._h = state_hash(head)
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


def tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCK_BUF)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCK_BUF)


class StateServer:
    """The donor's side: listens on an ephemeral port and serves one snapshot to N receivers, each
    in a session of its own (a receiver takes slices of several donors at once: a donor serving one
    session at a time could wait on a receiver that waits on another donor)."""

    def __init__(self, secret: bytes, host: str) -> None:
        self._secret = secret
        self._listener = socket.create_server((host, 0))
        tune(self._listener)
        self.port: int = self._listener.getsockname()[1]
        self.stream_seconds = 0.0  # bytes on the wire only, summed over sessions
        self.bytes_sent = 0
        self._lock = threading.Lock()

    def serve(
        self,
        snap: Snapshot,
        receivers: int,
        timeout: timedelta,
        on_progress: Progress,
        stop: Callable[[], bool] = lambda: False,
    ) -> str:
        """Serve `snap` to `receivers` authenticated peers within `timeout`; returns the donor's
        digest.

        A connection that fails or stalls before it proves the job's secret (a port scanner, a
        connect-then-close, garbage bytes, a silent peer) is dropped after at most `AUTH_TIMEOUT`
        and the transfer goes on; more than `MAX_STRAYS` of them fail it. `stop()` is asked at least
        every `_STOP_POLL` seconds: true, the serving is called off. A session that breaks fails the
        serving (its receiver is gone or took its slices elsewhere)."""
        deadline = time.monotonic() + timeout.total_seconds()
        digest = _digest_of(snap)
        sessions: list[tuple[socket.socket, threading.Thread]] = []
        errors: list[str] = []
        strays = 0
        try:
            while len(sessions) < receivers or any(t.is_alive() for _, t in sessions):
                if errors:
                    raise TransferError(errors[0])
                if time.monotonic() >= deadline:
                    raise TransferError(
                        f"{receivers} receiver(s) expected: not all came and finished"
                    )
                if stop():
                    raise TransferError("called off by the coordinator")
                if len(sessions) >= receivers:
                    sessions[-1][1].join(_STOP_POLL)  # all came: poll until they finish
                    continue
                conn, stray = self._accept(min(deadline - time.monotonic(), _STOP_POLL))
                strays += stray
                if strays > MAX_STRAYS:
                    raise TransferError(f"{strays} connections failed before authenticating")
                if conn is None:
                    continue
                conn.settimeout(timeout.total_seconds())
                t = threading.Thread(
                    target=self._session,
                    args=(conn, snap, digest, on_progress, errors),
                    daemon=True,
                )
                t.start()
                sessions.append((conn, t))
            if errors:
                raise TransferError(errors[0])
        finally:
            self._listener.close()
            for conn, t in sessions:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)  # a session still running (called off) ends now
                t.join(5)
                conn.close()
        return digest.result()

    def _accept(self, wait: float) -> tuple[socket.socket | None, bool]:
        """The next authenticated peer (None if nobody came within `wait`), and whether a stray
        came."""
        self._listener.settimeout(max(wait, 0.001))
        try:
            conn, _addr = self._listener.accept()
        except TimeoutError:
            return None, False
        conn.settimeout(AUTH_TIMEOUT.total_seconds())
        try:
            tune(conn)
            authenticate_server(conn, self._secret)
        except (AuthError, OSError, ConnectionError, ProtocolError):
            conn.close()  # not a peer of this job: it gets nothing, the real receivers still do
            return None, True
        return conn, False

    def _session(
        self,
        conn: socket.socket,
        snap: Snapshot,
        digest: Future[str],
        on_progress: Progress,
        errors: list[str],
    ) -> None:
        """The header, then each range the receiver asks for, until it acknowledges."""
        try:
            send_frame(conn, wire.StateHeader(header=snap.header, manifest=snap.manifest()))
            while True:
                ask = recv_frame(conn)
                if isinstance(ask, wire.StateAck):
                    return
                if not isinstance(ask, wire.StateWant) or ask.stop > snap.nbytes:
                    raise ProtocolError(
                        f"expected a range of the state's {snap.nbytes} bytes, got {ask!r}"
                    )
                hasher = Hasher()
                t0 = time.perf_counter()
                for chunk in snap.host_range(ask.start, ask.stop):
                    for i in range(0, len(chunk), CHUNK):
                        piece = chunk[i : i + CHUNK]
                        hasher.feed(piece)
                        conn.sendall(piece)
                        with self._lock:
                            self.bytes_sent += len(piece)
                            sent = self.bytes_sent
                        on_progress(sent)
                with self._lock:
                    self.stream_seconds += time.perf_counter() - t0
                send_frame(
                    conn, wire.StateEnd(digest=digest.result(), slice_digest=hasher.hexdigest())
                )
        except (OSError, ConnectionError, ProtocolError) as e:
            errors.append(f"serving state failed: {e}")


def _digest_of(snap: Snapshot) -> Future[str]:
    """The snapshot's digest, computed in a thread of its own while the sessions start."""
    out: Future[str] = Future()

    def run() -> None:
        try:
            out.set_result(snap.digest())
        except Exception as e:  # handed to whoever waits for it
            out.set_exception(e)

    threading.Thread(target=run, name="torchpass-digest", daemon=True).start()
    return out
