"""Ctrl-C and a scheduler's SIGTERM end a job the orderly way (the coordinator's `run`)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def stopped_by_signals(stop: Callable[[str], None]) -> Iterator[None]:
    """Ctrl-C or SIGTERM (a scheduler ending the job) stop the job the orderly way: its ranks are
    told to exit, its result and incidents are written and its secret removed. A second one is the
    default (an impatient Ctrl-C still ends the process; the ranks die with it). Off the main
    thread, nothing."""
    loop = asyncio.get_running_loop()
    caught: list[signal.Signals] = []

    def on_signal(sig: signal.Signals) -> None:
        loop.remove_signal_handler(sig)
        caught.append(sig)
        stop(f"stopped by {sig.name} (the job did not finish; its state so far is recorded)")

    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, on_signal, sig)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or not Unix
            continue
        installed.append(sig)
    try:
        yield
    finally:
        for sig in installed:
            if sig not in caught:
                loop.remove_signal_handler(sig)
