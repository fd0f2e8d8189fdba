"""The control port's accept path: every connection's handshake on one selector, in the accept
thread, with no thread of its own until it has proved the job's secret.

A connection that has not finished its handshake within `AUTH_TIMEOUT` is dropped, and at most
`max_pending` wait at once: past it the oldest is dropped for the newcomer, so a flood of silent
connections (1,500 once took the coordinator from 18 to 667 threads) costs no thread and holds the
port for no longer than it keeps flooding; a rank's handshake, a round trip, gets through between.
Running out of file descriptors pauses the accepts instead of ending them.
"""

from __future__ import annotations

import contextlib
import errno
import selectors
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

from job_agent.wire import protocol

AUTH_TIMEOUT = timedelta(seconds=10)
MAX_PENDING = 256
_TICK = 0.25  # seconds between sweeps of the expired


@dataclass
class _Pending:
    nonce: bytes
    deadline: float
    reply: bytearray = field(default_factory=bytearray)


class Handshakes:
    """Accepts on `listener` until `closed()`; hands each authenticated connection to `admit`
    (blocking again, its frames tagged) and each refused one to `refuse` with why."""

    def __init__(
        self,
        listener: socket.socket,
        secret: bytes,
        admit: Callable[[socket.socket], None],
        refuse: Callable[[socket.socket, str], None],
        max_pending: int = MAX_PENDING,
        timeout: timedelta = AUTH_TIMEOUT,
    ) -> None:
        self._listener, self._secret = listener, secret
        self._admit, self._refuse = admit, refuse
        self._max, self._timeout = max_pending, timeout.total_seconds()
        self._pending: dict[socket.socket, _Pending] = {}  # oldest first
        self._sel = selectors.DefaultSelector()

    @property
    def pending(self) -> int:
        return len(self._pending)

    def run(self, closed: Callable[[], bool]) -> None:
        # A connection reset between the select and the accept must not block the accepts.
        self._listener.setblocking(False)
        self._sel.register(self._listener, selectors.EVENT_READ)
        try:
            while not closed():
                for key, _ in self._sel.select(_TICK):
                    if key.fileobj is self._listener:
                        if not self._accept():
                            return
                    else:
                        assert isinstance(key.fileobj, socket.socket)
                        self._read(key.fileobj)
                self._expire()
        finally:
            for conn in list(self._pending):
                self._drop(conn, "the coordinator stopped")
            self._sel.close()

    def _accept(self) -> bool:
        """One connection in; False once the listener is closed."""
        try:
            conn, _ = self._listener.accept()
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                time.sleep(_TICK)  # out of descriptors: the expired make room, accepts go on
                return True
            return e.errno in (errno.EAGAIN, errno.ECONNABORTED, errno.EINTR)
        if len(self._pending) >= self._max:
            oldest = next(iter(self._pending))
            self._drop(oldest, f"{self._max} handshakes pending: the oldest dropped")
        nonce = protocol.server_challenge()
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.setblocking(False)
            conn.send(nonce)  # 16 bytes into an empty buffer
        except OSError as e:
            self._refuse(conn, f"refused: {e}")
            conn.close()
            return True
        self._pending[conn] = _Pending(nonce, time.monotonic() + self._timeout)
        self._sel.register(conn, selectors.EVENT_READ)
        return True

    def _read(self, conn: socket.socket) -> None:
        p = self._pending.get(conn)
        if p is None:
            return
        try:
            data = conn.recv(protocol.CLIENT_REPLY_BYTES - len(p.reply))
        except BlockingIOError:
            return
        except OSError as e:
            self._drop(conn, f"refused: {e}")
            return
        if not data:
            self._drop(conn, "refused: peer closed the connection")
            return
        p.reply += data
        if len(p.reply) < protocol.CLIENT_REPLY_BYTES:
            return
        self._sel.unregister(conn)
        del self._pending[conn]
        try:
            conn.setblocking(True)
            conn.settimeout(self._timeout)
            protocol.finish_server(conn, self._secret, p.nonce, bytes(p.reply))
            conn.settimeout(None)
        except (OSError, protocol.ProtocolError) as e:
            # A peer without the job's secret: refused before it can say anything.
            self._refuse(conn, f"refused: {e}")
            conn.close()
            return
        self._admit(conn)

    def _expire(self) -> None:
        now = time.monotonic()
        for conn in [c for c, p in self._pending.items() if p.deadline <= now]:
            self._drop(conn, f"refused: no handshake within {self._timeout:.0f} s")

    def _drop(self, conn: socket.socket, why: str) -> None:
        del self._pending[conn]
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(conn)
        self._refuse(conn, why)
        conn.close()
