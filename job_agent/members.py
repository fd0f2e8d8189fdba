"""The coordinator's view of one process of the job, and the control-channel server feeding it."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from job_agent import protocol


@dataclass
class Member:
    """A rank or spare process, from its hello to its exit."""

    agent_id: str
    role: str  # "rank" | "spare"
    slot: int
    pid: int
    node: str
    conn: socket.socket | None = None
    state: str = "connected"  # connected, ready, training, frozen, done, lost
    last_heartbeat: float = field(default_factory=time.monotonic)
    step: int = -1
    step_at: float = 0.0
    step_wall: float = 0.0
    collective_step: int = -1
    collective_at: float = 0.0
    completed: int = -1
    frozen_at: float | None = None  # monotonic time of its last "frozen" report while training
    fenced: bool = False
    reserved_for: str | None = None
    replies: dict[str, dict[str, Any]] = field(default_factory=dict)
    digest: str | None = None

    @property
    def alive(self) -> bool:
        return self.state not in ("lost", "exited")

    def send(self, msg: dict[str, Any]) -> None:
        if self.conn is None:
            return
        # The reader thread reports the loss; a send to a dying process is not an error here.
        with contextlib.suppress(OSError):
            protocol.send_frame(self.conn, msg)


Handler = Callable[[socket.socket, dict[str, Any], float], None]


class ControlServer:
    """Accepts authenticated connections; each runs a reader thread that hands frames to the event loop.

    Threads only read and forward: every state change happens on the coordinator's event loop, so the
    coordinator has one writer and needs no locks.
    """

    def __init__(self, secret: bytes, loop: asyncio.AbstractEventLoop, on_frame: Handler, on_close: Handler):
        self._secret = secret
        self._loop = loop
        self._on_frame = on_frame
        self._on_close = on_close
        self._listener = socket.create_server(("127.0.0.1", 0))
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
            conn.settimeout(10.0)
            protocol.authenticate_server(conn, self._secret)
            conn.settimeout(None)
        except (OSError, ConnectionError, protocol.ProtocolError) as e:
            # A peer without the job's secret: refused before it can say anything.
            self._loop.call_soon_threadsafe(
                self._on_close, conn, {"t": "refused", "reason": str(e)}, time.time()
            )
            conn.close()
            return
        reason = "closed"
        try:
            while True:
                msg = protocol.recv_frame(conn)
                self._loop.call_soon_threadsafe(self._on_frame, conn, msg, time.time())
        except (OSError, ConnectionError, protocol.ProtocolError) as e:
            reason = str(e) or type(e).__name__
        self._loop.call_soon_threadsafe(self._on_close, conn, {"t": "closed", "reason": reason}, time.time())

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
