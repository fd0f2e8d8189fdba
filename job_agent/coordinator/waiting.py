"""Bounded waits on the coordinator's event loop: wake on every change of the job, never wait forever."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from datetime import timedelta

_POLL = 1.0  # seconds: re-check the predicate (and call `tick`) at least this often


class JobFailed(Exception):
    """The job cannot go on: a script error, a start-up failure, an unrecoverable incident."""


class Changes:
    """Signalled whenever the coordinator's view of the job changes; `stop` fails every wait."""

    def __init__(self) -> None:
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
        """Until `pred()` holds; TimeoutError naming `what` after `timeout` (None only under an outer
        timeout), JobFailed once the job stopped. `tick` runs at least once a second (heartbeats)."""
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        while not pred():
            if self._stopped is not None:
                raise JobFailed(self._stopped)
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                assert timeout is not None
                raise TimeoutError(f"timed out after {timeout.total_seconds():.1f} s waiting for {what}")
            self._event.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._event.wait(), min(left or _POLL, _POLL))
            if tick is not None:
                tick()
