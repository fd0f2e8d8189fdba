"""A rank's connection to its coordinator: the hello, a reader thread, heartbeats, an inbox of
commands.

A non-zero `Exit` is obeyed at once by the reader thread, even while the main thread is blocked in a
collective, and so is an aborting `Freeze` (the group's sockets are cut). So is the end-of-job
`Exit` to a spare that never took a slot; a spare given one (`Assign`) is a rank from then on, and
finishes like one: back to the script, to run its code after the training loop.

A lost coordinator ends the process, unless the process may rejoin (`rejoin_for`, set on the nodes
of a multi-node job): then it goes on training, its reports dropped meanwhile, and rejoins the
coordinator at the same address (restarted with the job's state directory) with a hello marked
`rejoin` followed by what it is now (`rejoin_frames`); past `rejoin_for` with no coordinator, it
stops.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

from job_agent import wire
from job_agent.wire import protocol
from job_agent.wire.protocol import EXIT_COORDINATOR_LOST

CONNECT_TIMEOUT = timedelta(seconds=30)
_REJOIN_EVERY = 0.5


def exit_now(code: int, reason: str) -> None:
    if reason:
        print(f"torchpass: {reason}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)


class CoordinatorLink:
    def __init__(
        self,
        host: str,
        port: int,
        secret: bytes,
        hello: wire.Hello,
        heartbeat: timedelta,
        rejoin_for: timedelta = timedelta(0),
    ) -> None:
        self.inbox: queue.SimpleQueue[wire.Frame] = queue.SimpleQueue()
        self._addr, self._secret, self._rejoin_for = (host, port), secret, rejoin_for
        # The hello (marked rejoin) and what this process is now, said to a restarted coordinator.
        self.rejoin_frames: Callable[[], list[wire.Frame]] = lambda: [
            hello.model_copy(update={"rejoin": True})
        ]
        # set once this rank is done: a closing coordinator is no loss
        self.finished = threading.Event()
        self._spare = hello.role is wire.Role.SPARE
        self._heartbeat = heartbeat
        self._lock = threading.Lock()
        # Called by the reader thread on an aborting freeze, while the main thread may be blocked in
        # a collective of the group to abandon (`job_agent.rank.sever`).
        self.on_abort: Callable[[], None] | None = None
        self._sock = protocol.connect(host, port, secret, CONNECT_TIMEOUT)
        protocol.send_frame(self._sock, hello)
        reply = protocol.recv_frame(self._sock)
        if not isinstance(reply, wire.Welcome):
            reason = reply.reason if isinstance(reply, wire.Reject | wire.Error) else reply.t
            raise RuntimeError(f"coordinator refused this process: {reason}")
        threading.Thread(target=self._read_loop, name="torchpass-control", daemon=True).start()
        threading.Thread(
            target=self._heartbeat_loop, name="torchpass-heartbeat", daemon=True
        ).start()

    def send(self, frame: wire.Frame) -> None:
        with self._lock:
            try:
                protocol.send_frame(self._sock, frame)
            except OSError:
                if not self._rejoin_for:
                    raise
                # Dropped: the reader is rejoining, and says again what this process is when it has.

    def close(self) -> None:
        self.finished.set()
        self._sock.close()

    def _read_loop(self) -> None:
        while True:
            try:
                frame = protocol.recv_frame(self._sock)
            except (OSError, ConnectionError, protocol.ProtocolError) as e:
                if self.finished.is_set():
                    return
                if not self._rejoin(e):
                    exit_now(
                        EXIT_COORDINATOR_LOST,
                        "lost the connection to the job coordinator; stopping",
                    )
                continue
            if isinstance(frame, wire.Assign):
                # Read here, in the order frames came: from now on this process is a rank, whose
                # code after the training loop must run when the job ends.
                self._spare = False
            if isinstance(frame, wire.Exit) and (frame.code != 0 or self._spare):
                exit_now(frame.code, frame.reason)
            if isinstance(frame, wire.Freeze) and frame.abort and self.on_abort is not None:
                self.on_abort()
            self.inbox.put(frame)

    def _rejoin(self, why: Exception) -> bool:
        """Back to a coordinator at the same address within `rejoin_for`, or False. One that refuses
        this process (not yet told of it by its node, or fenced it) is asked again until then."""
        if not self._rejoin_for:
            return False
        wait = self._rejoin_for.total_seconds()
        print(
            f"torchpass: lost the job coordinator ({why}); going on, rejoining for {wait:.0f} s",
            file=sys.stderr,
        )
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and not self.finished.is_set():
            time.sleep(_REJOIN_EVERY)
            frames = self.rejoin_frames()
            try:
                sock = protocol.connect(*self._addr, self._secret, CONNECT_TIMEOUT)
            except (OSError, ConnectionError, protocol.ProtocolError):
                continue
            try:
                protocol.send_frame(sock, frames[0])
                if isinstance(protocol.recv_frame(sock), wire.Welcome):
                    with self._lock:
                        self._sock.close()
                        self._sock = sock
                        for f in frames[1:]:
                            protocol.send_frame(sock, f)
                    print("torchpass: rejoined the job coordinator", file=sys.stderr, flush=True)
                    return True
            except (OSError, ConnectionError, protocol.ProtocolError):
                pass
            sock.close()
        return False

    def _heartbeat_loop(self) -> None:
        beat = wire.Heartbeat()
        while not self.finished.wait(self._heartbeat.total_seconds()):
            try:
                self.send(beat)
            except OSError:
                return
