"""The coordinator's control channel: authenticated connections, one reader thread each (a
connection gets its thread once it has proved the job's secret: `handshakes.py`).

Threads only read, decode and forward: every state change happens on the coordinator's event loop,
so the coordinator has one writer and needs no locks. A frame that does not decode reaches the
handler as a `wire.BadFrame` (answered with a typed error frame); it never closes the connection.

Frames reach the loop through one `_Inbox`, in arrival order and in batches: one wake-up of the loop
per batch rather than per frame. (Woken per frame, a coordinator of 1,024 ranks took 7,000 wake-ups
a second, filled its loop's self-pipe and fell behind for good; `bench/coordinator.py` measures it.)
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from job_agent import wire
from job_agent.coordinator.handshakes import Handshakes
from job_agent.wire import protocol

FrameHandler = Callable[[socket.socket, "wire.Frame | wire.BadFrame", float], None]
CloseHandler = Callable[[socket.socket, str, float], None]


def send(conn: socket.socket, frame: wire.Frame) -> None:
    """Send, or nothing when the peer already hung up: the reader thread reports the loss."""
    with contextlib.suppress(OSError):
        protocol.send_frame(conn, frame)


def cut(conn: socket.socket | None) -> None:
    """End a peer's connection from this side: its reader thread sees it close and reports the
    loss."""
    if conn is not None:
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)


class _Inbox:
    """Calls from the reader threads, run on the loop in the order they arrived, `BATCH` at a time
    (the loop's other work runs between batches)."""

    BATCH = 256

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._calls: deque[tuple[Callable[..., None], tuple[Any, ...]]] = deque()
        self._lock = threading.Lock()
        self._armed = False  # a drain is scheduled: later calls ride on it

    def put(self, fn: Callable[..., None], *args: Any) -> None:
        with self._lock:
            self._calls.append((fn, args))
            if self._armed:
                return
            self._armed = True
        with contextlib.suppress(RuntimeError):  # the loop closed at shutdown: nobody is listening
            self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            batch = [self._calls.popleft() for _ in range(min(self.BATCH, len(self._calls)))]
            self._armed = bool(self._calls)
        for fn, args in batch:
            try:
                fn(*args)
            # as the loop treats a failing callback: reported, the rest go on
            except Exception as e:
                self._loop.call_exception_handler(
                    {"message": f"control channel: {fn!r} failed", "exception": e}
                )
        if self._armed:
            self._loop.call_soon(self._drain)


class ControlServer:
    """Listens on `host` (`port`, or an ephemeral one); hands every frame and every close to the
    event loop."""

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
        self._inbox = _Inbox(loop)
        self._on_frame = on_frame
        self._on_close = on_close
        self._listener = socket.create_server((host, port))
        self.port: int = self._listener.getsockname()[1]
        self._closed = threading.Event()
        threading.Thread(target=self._accept_loop, name="torchpass-accept", daemon=True).start()

    def _accept_loop(self) -> None:
        def admit(conn: socket.socket) -> None:
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

        def refuse(conn: socket.socket, why: str) -> None:
            self._inbox.put(self._on_close, conn, why, time.time())

        Handshakes(self._listener, self._secret, admit, refuse).run(self._closed.is_set)

    def _serve(self, conn: socket.socket) -> None:
        """An authenticated connection's reader: every frame to the loop, then its close."""
        reason = "closed"
        try:
            while True:
                body = protocol.recv_body(conn)
                frame: wire.Frame | wire.BadFrame
                try:
                    frame = wire.decode(body)
                except wire.BadFrame as e:
                    frame = e
                self._inbox.put(self._on_frame, conn, frame, time.time())
        except (OSError, ConnectionError, protocol.ProtocolError) as e:
            reason = str(e) or type(e).__name__
        self._inbox.put(self._on_close, conn, reason, time.time())
        self._inbox.put(conn.close)  # on the loop, after the close is handled: no send races

    def close(self) -> None:
        self._closed.set()
        # close() alone leaves the accept loop blocked in accept() and the port listening: wake it.
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
