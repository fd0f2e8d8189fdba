"""A rank's side of a state transfer: serving its state to receivers (a donor), or taking a donor's
in (a receiver), each reported to the coordinator with the figures the proof and the outcome are
made of."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

from job_agent import wire
from job_agent.transfer.donor import StateServer, TransferError
from job_agent.transfer.receiver import receive_state
from job_agent.transfer.snapshot import Transferable

_PROGRESS_EVERY = 0.5  # seconds between a donor's progress reports while it streams

Send = Callable[[wire.Frame], None]


def serve(
    tracked: Transferable,
    secret: bytes,
    host: str,
    step: int,
    order: wire.Serve,
    send: Send,
    stop: Callable[[], bool],
) -> None:
    """Serve the state of completed step `step` to `order.receivers` receivers. `stop` turning true
    while it waits for them means the plan changed (a receiver was lost): it stops serving this
    one."""
    server = StateServer(secret, host)
    send(wire.Serving(host=host, port=server.port, step=step, transfer=order.transfer))
    t0 = time.perf_counter()
    snap = tracked.snapshot(step)
    last = [t0]

    def progress(sent: int) -> None:  # what the transfer activity's heartbeats carry
        if time.perf_counter() - last[0] >= _PROGRESS_EVERY:
            last[0] = time.perf_counter()
            send(wire.TransferProgress(bytes=sent))

    try:
        timeout = timedelta(seconds=order.timeout)
        digest = server.serve(snap, order.receivers, timeout, on_progress=progress, stop=stop)
    except TransferError as e:
        send(wire.TransferFailed(error=str(e)[:4000], transfer=order.transfer))
        return
    send(wire.TransferProgress(bytes=server.bytes_sent))
    send(
        wire.Served(
            digest=digest,
            step=step,
            bytes=server.bytes_sent,
            seconds=time.perf_counter() - t0,
            stream_seconds=server.stream_seconds,
            transfer=order.transfer,
        )
    )


def receive(tracked: Transferable, secret: bytes, order: wire.Receive, send: Send) -> int | None:
    """Take a donor's state in; its step, or None when the transfer failed (reported)."""
    try:
        stats = receive_state(tracked, order.sources, secret, timedelta(seconds=order.timeout))
    except TransferError as e:
        send(wire.TransferFailed(error=str(e)[:4000], transfer=order.transfer))
        return None
    # The proof's receiver side: what this rank holds now, hashed from its own memory, not the bytes
    # that arrived (a load that altered anything would show here).
    installed = tracked.snapshot(stats.step).digest()
    send(
        wire.Received(
            stream_digest=stats.digest,
            installed_digest=installed,
            step=stats.step,
            bytes=stats.nbytes,
            seconds=stats.seconds,
            transfer=order.transfer,
            stripes=stats.stripes,
            dropped=stats.dropped,
        )
    )
    return stats.step
