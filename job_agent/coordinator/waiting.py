"""Bounded waits on the coordinator's event loop: wake on every change of the job, never wait
forever."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import timedelta

from job_agent.coordinator.clock import SYSTEM, Clock

_POLL = 1.0  # seconds: re-check the predicate (and call `tick`) at least this often


class JobFailed(Exception):
    """The job cannot go on: a script error, a start-up failure, an unrecoverable incident."""


class Changes:
    """Signalled whenever the coordinator's view of the job changes; `stop` fails every wait."""

    def __init__(self, clock: Clock = SYSTEM) -> None:
        self.clock = clock
        self._event = asyncio.Event()
        self._stopped: str | None = None

    def notify(self) -> None:
        self._event.set()

    def stop(self, reason: str) -> None:
        self._stopped = reason
        self._event.set()

    async def wait_for(
        self,
        pred: Callable[[], bool],
        timeout: timedelta | None,
        what: str,
        tick: Callable[[], None] | None = None,
    ) -> None:
        """Until `pred()` holds; TimeoutError naming `what` after `timeout` (None only under an
        outer timeout), JobFailed once the job stopped. `tick` runs at least once a second
        (heartbeats)."""
        clock = self.clock
        deadline = None if timeout is None else clock.monotonic() + timeout.total_seconds()
        while not pred():
            if self._stopped is not None:
                raise JobFailed(self._stopped)
            left = None if deadline is None else deadline - clock.monotonic()
            if left is not None and left <= 0:
                assert timeout is not None
                raise TimeoutError(
                    f"timed out after {timeout.total_seconds():.1f} s waiting for {what}"
                )
            self._event.clear()
            await clock.wait(self._event, min(left or _POLL, _POLL))
            if tick is not None:
                tick()
