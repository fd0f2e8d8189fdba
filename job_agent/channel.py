"""The coordinator's control channel: authenticated connections, one reader thread each.

Threads only read, decode and forward: every state change happens on the coordinator's event loop, so
the coordinator has one writer and needs no locks. A frame that does not decode reaches the handler as a
`wire.BadFrame` (answered with a typed error frame); it never closes the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta

from job_agent import protocol, wire

AUTH_TIMEOUT = timedelta(seconds=10)

FrameHandler = Callable[[socket.socket, "wire.Frame | wire.BadFrame", float], None]
CloseHandler = Callable[[socket.socket, str, float], None]


def send(conn: socket.socket, frame: wire.Frame) -> None:
    """Send, or nothing when the peer already hung up: the reader thread reports the loss."""
    with contextlib.suppress(OSError):
        protocol.send_frame(conn, frame)


def cut(conn: socket.socket | None) -> None:
    """End a peer's connection from this side: its reader thread sees it close and reports the loss."""
    if conn is not None:
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)


class ControlServer:
    """Listens on `host` (`port`, or an ephemeral one); hands every frame and every close to the event
    loop."""

    def __init__(
        self,
        secret: bytes,
        loop: asyncio.AbstractEventLoop,
        on_frame: FrameHandler,
        on_close: CloseHandler,
        host: str,
        port: int = 0,
    ) -> None:
        self._secret = secret
        self._loop = loop
        self._on_frame = on_frame
        self._on_close = on_close
        self._listener = socket.create_server((host, port))
        self.port: int = self._listener.getsockname()[1]
        self._closed = threading.Event()
        threading.Thread(target=self._accept_loop, name="torchpass-accept", daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            conn.settimeout(AUTH_TIMEOUT.total_seconds())
            protocol.authenticate_server(conn, self._secret)
            conn.settimeout(None)
        except (OSError, ConnectionError, protocol.ProtocolError) as e:
            # A peer without the job's secret: refused before it can say anything.
            self._loop.call_soon_threadsafe(self._on_close, conn, f"refused: {e}", time.time())
            conn.close()
            return
        reason = "closed"
        try:
            while True:
                body = protocol.recv_body(conn)
                frame: wire.Frame | wire.BadFrame
                try:
                    frame = wire.decode(body)
                except wire.BadFrame as e:
                    frame = e
                self._loop.call_soon_threadsafe(self._on_frame, conn, frame, time.time())
        except (OSError, ConnectionError, protocol.ProtocolError) as e:
            reason = str(e) or type(e).__name__
        self._loop.call_soon_threadsafe(self._on_close, conn, reason, time.time())
        self._loop.call_soon_threadsafe(conn.close)  # on the loop, after the close is handled: no send races

    def close(self) -> None:
        self._closed.set()
        # close() alone leaves the accept loop blocked in accept() and the port listening: wake it.
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
