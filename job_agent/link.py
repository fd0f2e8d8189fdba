"""A rank's connection to its coordinator: the hello, a reader thread, heartbeats, an inbox of commands.

A non-zero `Exit` is obeyed at once by the reader thread, even while the main thread is blocked in a
collective, and so is an aborting `Freeze` (the group's sockets are cut); a lost coordinator ends the
process (a rank without one could never recover).
"""

from __future__ import annotations

import os
import queue
import sys
import threading
from collections.abc import Callable
from datetime import timedelta

from job_agent import protocol, wire

EXIT_COORDINATOR_LOST = 70
CONNECT_TIMEOUT = timedelta(seconds=30)


def exit_now(code: int, reason: str) -> None:
    if reason:
        print(f"torchpass: {reason}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)


class CoordinatorLink:
    def __init__(self, host: str, port: int, secret: bytes, hello: wire.Hello, heartbeat: timedelta) -> None:
        self.inbox: queue.SimpleQueue[wire.Frame] = queue.SimpleQueue()
        self.finished = threading.Event()  # set once this rank is done: a closing coordinator is no loss
        self._spare = hello.role is wire.Role.SPARE
        self._heartbeat = heartbeat
        self._lock = threading.Lock()
        # Called by the reader thread on an aborting freeze, while the main thread may be blocked in a
        # collective of the group to abandon (`job_agent.sever`).
        self.on_abort: Callable[[], None] | None = None
        self._sock = protocol.connect(host, port, secret, CONNECT_TIMEOUT)
        protocol.send_frame(self._sock, hello)
        reply = protocol.recv_frame(self._sock)
        if not isinstance(reply, wire.Welcome):
            reason = reply.reason if isinstance(reply, wire.Reject | wire.Error) else reply.t
            raise RuntimeError(f"coordinator refused this process: {reason}")
        threading.Thread(target=self._read_loop, name="torchpass-control", daemon=True).start()
        threading.Thread(target=self._heartbeat_loop, name="torchpass-heartbeat", daemon=True).start()

    def send(self, frame: wire.Frame) -> None:
        with self._lock:
            protocol.send_frame(self._sock, frame)

    def close(self) -> None:
        self.finished.set()
        self._sock.close()

    def _read_loop(self) -> None:
        try:
            while True:
                frame = protocol.recv_frame(self._sock)
                if isinstance(frame, wire.Exit) and (frame.code != 0 or self._spare):
                    exit_now(frame.code, frame.reason)
                if isinstance(frame, wire.Freeze) and frame.abort and self.on_abort is not None:
                    self.on_abort()
                self.inbox.put(frame)
        except (OSError, ConnectionError, protocol.ProtocolError):
            if not self.finished.is_set():
                exit_now(EXIT_COORDINATOR_LOST, "lost the connection to the job coordinator; stopping")

    def _heartbeat_loop(self) -> None:
        beat = wire.Heartbeat()
        while not self.finished.wait(self._heartbeat.total_seconds()):
            try:
                self.send(beat)
            except OSError:
                return
