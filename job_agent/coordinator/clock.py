"""The coordinator's time, given to it: monotonic seconds for every timeout and silence it measures,
wall time for the evidence it writes, and its sleeps and bounded waits.

`SYSTEM` is the real clock. A test gives a `SimulatedClock`, whose time moves only when the test
moves it (`advance`): the hang, freeze and heartbeat logic then runs in simulated time, a 30 s
timeout in a few milliseconds, with nothing left to the machine's load.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import time
from datetime import UTC, datetime


class Clock:
    """The real clock (the base a test's clock overrides)."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    def now(self) -> datetime:
        return datetime.fromtimestamp(self.wall(), UTC)

    def as_wall(self, monotonic: float) -> datetime:
        """A monotonic instant of this clock as wall-clock time."""
        return datetime.fromtimestamp(self.wall() - (self.monotonic() - monotonic), UTC)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def wait(self, event: asyncio.Event, seconds: float) -> bool:
        """Until `event` is set or `seconds` passed; whether it was set."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), seconds)
        return event.is_set()


SYSTEM = Clock()


class SimulatedClock(Clock):
    """Time that passes only when the test calls `advance`; every sleeper due by then wakes, in
    order, each given its turn on the event loop before time moves on."""

    def __init__(self, start: float = 1000.0, wall_at_start: float = 1.7e9) -> None:
        self._now = start
        self._wall_offset = wall_at_start - start
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    def monotonic(self) -> float:
        return self._now

    def wall(self) -> float:
        return self._now + self._wall_offset

    async def sleep(self, seconds: float) -> None:
        wake = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self._now + max(seconds, 0.0), next(self._order), wake))
        await wake

    async def wait(self, event: asyncio.Event, seconds: float) -> bool:
        if event.is_set():
            return True
        waiter = asyncio.ensure_future(event.wait())
        sleeper = asyncio.ensure_future(self.sleep(seconds))
        await asyncio.wait({waiter, sleeper}, return_when=asyncio.FIRST_COMPLETED)
        for task in (waiter, sleeper):
            task.cancel()
        return event.is_set()

    def skip(self, seconds: float) -> None:
        """Move time forward where nothing sleeps (code that only reads the clock)."""
        assert not self._sleepers, "something sleeps on this clock: advance it instead"
        self._now += seconds

    async def advance(self, seconds: float) -> None:
        """Move time forward by `seconds`, waking every sleeper due on the way at its own
        instant."""
        until = self._now + seconds
        await _settle()
        while self._sleepers and self._sleepers[0][0] <= until:
            due, _, wake = heapq.heappop(self._sleepers)
            self._now = max(self._now, due)
            if not wake.done():
                wake.set_result(None)
            await _settle()
        self._now = until
        await _settle()


async def _settle(turns: int = 20) -> None:
    """Let the tasks just woken run until they wait again (a few turns of the loop)."""
    for _ in range(turns):
        await asyncio.sleep(0)
