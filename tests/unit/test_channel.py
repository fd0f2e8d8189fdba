"""The coordinator's control channel over real loopback sockets: what reaches its event loop, in
what order, and at what cost in wake-ups."""

from __future__ import annotations

import asyncio
import socket
import threading
from datetime import timedelta
from typing import Any

from job_agent import wire
from job_agent.coordinator.channel import ControlServer
from job_agent.wire import protocol

SECRET = b"s" * 32
PEERS, FRAMES = 8, 300


async def _serve_peers(
    on_frame_extra: Any = None,
) -> tuple[dict[socket.socket, list[object]], int, list[dict[str, Any]]]:
    """PEERS clients each send FRAMES steps and hang up; returns what each connection's handler saw
    (in order, its close last), the loop's cross-thread wake-ups and the errors the loop was told
    of."""
    loop = asyncio.get_running_loop()
    seen: dict[socket.socket, list[object]] = {}
    closed = asyncio.Event()
    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    wakeups = 0
    real = loop.call_soon_threadsafe

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal wakeups
        wakeups += 1
        return real(*args, **kwargs)

    loop.call_soon_threadsafe = counted  # type: ignore[method-assign,assignment]

    def on_frame(conn: socket.socket, frame: wire.Frame | wire.BadFrame, ts: float) -> None:
        if on_frame_extra is not None:
            on_frame_extra(frame)
        assert isinstance(frame, wire.Step)
        seen.setdefault(conn, []).append(frame.k)

    def on_close(conn: socket.socket, reason: str, ts: float) -> None:
        seen.setdefault(conn, []).append("closed")
        if sum(v[-1] == "closed" for v in seen.values()) == PEERS:
            closed.set()

    server = ControlServer(SECRET, loop, on_frame, on_close, "127.0.0.1")

    def peer() -> None:
        with protocol.connect("127.0.0.1", server.port, SECRET, timedelta(seconds=10)) as s:
            for k in range(FRAMES):
                protocol.send_frame(s, wire.Step(k=k))

    threads = [threading.Thread(target=peer) for _ in range(PEERS)]
    try:
        for t in threads:
            t.start()
        await asyncio.wait_for(closed.wait(), 30)
    finally:
        for t in threads:
            t.join(10)
        server.close()
        loop.call_soon_threadsafe = real  # type: ignore[method-assign]
    return seen, wakeups, errors


async def test_every_frame_reaches_the_loop_in_order_with_far_fewer_wakeups_than_frames() -> None:
    """Each connection's frames arrive in the order sent, its close after them; and the reader
    threads wake the loop per batch, not per frame (per frame, 7,000 frames a second at 1,024 ranks
    filled the loop's self-pipe and the coordinator fell behind for good)."""
    seen, wakeups, errors = await _serve_peers()
    assert not errors
    assert len(seen) == PEERS
    for got in seen.values():
        assert got == [*range(FRAMES), "closed"]
    # The loop is busy handling while the peers write, so most frames ride on a wake-up already due.
    # One per frame (PEERS * FRAMES + closes) would fail this.
    assert wakeups < PEERS * FRAMES / 2, wakeups


async def test_a_handler_that_fails_on_one_frame_is_reported_and_the_rest_still_arrive() -> None:
    def fail_on_seven(frame: object) -> None:
        if isinstance(frame, wire.Step) and frame.k == 7:
            raise ValueError("handler failed on step 7")

    seen, _, errors = await _serve_peers(fail_on_seven)
    assert len(errors) == PEERS
    assert all(isinstance(e["exception"], ValueError) for e in errors)
    for got in seen.values():
        assert got == [*(k for k in range(FRAMES) if k != 7), "closed"]


async def test_a_flood_of_silent_connections_costs_no_thread_and_a_rank_still_gets_in() -> None:
    """1,500 connections that never say a word (they once took the coordinator from 18 to 667
    threads): the handshakes wait on one selector, no thread each, at most `MAX_PENDING` (the oldest
    dropped), and a rank connecting in the middle of the flood authenticates and is heard."""
    loop = asyncio.get_running_loop()
    heard: list[wire.Frame | wire.BadFrame] = []
    refused: list[str] = []
    server = ControlServer(
        SECRET,
        loop,
        lambda conn, frame, ts: heard.append(frame),
        lambda conn, why, ts: refused.append(why),
        "127.0.0.1",
    )
    before = threading.active_count()
    silent: list[socket.socket] = []
    try:
        for _ in range(1500):
            silent.append(socket.create_connection(("127.0.0.1", server.port)))
        await asyncio.sleep(0.5)
        assert threading.active_count() <= before + 2, threading.active_count()

        def rank() -> None:
            with protocol.connect("127.0.0.1", server.port, SECRET, timedelta(seconds=10)) as s:
                protocol.send_frame(s, wire.Step(k=1))

        await asyncio.to_thread(rank)
        for _ in range(100):
            if heard:
                break
            await asyncio.sleep(0.02)
        assert heard == [wire.Step(k=1)]
        assert sum("handshakes pending: the oldest dropped" in r for r in refused) >= 1500 - 256
    finally:
        for s in silent:
            s.close()
        server.close()
