"""A process's answers to one state-transfer command, each awaited as a future of its own.

The coordinator numbers every transfer and its commands (`Serve`, `Receive`) carry the number; each
process commanded gets a fresh `TransferAnswers` for it. A frame that answers (`Serving`, `Served`,
`Received`, `TransferFailed`) settles that transfer's future, once; a frame numbered for another
transfer (a late answer to an earlier one) settles nothing.
"""

from __future__ import annotations

import asyncio
from typing import TypeVar

from job_agent import wire

F = TypeVar("F")
Answer = wire.Serving | wire.Served | wire.Received | wire.TransferFailed


def _settle(future: asyncio.Future[F], frame: F) -> None:
    if not future.done():
        future.set_result(frame)


def _answer(future: asyncio.Future[F]) -> F | None:
    return future.result() if future.done() else None


class TransferAnswers:
    """One process's answers to transfer number `transfer`: whether it listens (a donor's `Serving`,
    or its failure) and its account once done (`Served`, `Received`, or its failure)."""

    def __init__(self, transfer: int) -> None:
        loop = asyncio.get_running_loop()
        self.transfer = transfer
        self.listening: asyncio.Future[wire.Serving | wire.TransferFailed] = loop.create_future()
        self.account: asyncio.Future[wire.Served | wire.Received | wire.TransferFailed] = (
            loop.create_future()
        )

    def take(self, frame: Answer) -> None:
        """Settle what `frame` answers, if it answers this transfer."""
        if frame.transfer != self.transfer:
            return
        match frame:
            case wire.Serving():
                _settle(self.listening, frame)
            case wire.TransferFailed():
                _settle(self.listening, frame)
                _settle(self.account, frame)
            case wire.Served() | wire.Received():
                _settle(self.account, frame)

    def serving(self) -> wire.Serving | None:
        answer = _answer(self.listening)
        return answer if isinstance(answer, wire.Serving) else None

    def served(self) -> wire.Served | None:
        answer = _answer(self.account)
        return answer if isinstance(answer, wire.Served) else None

    def received(self) -> wire.Received | None:
        answer = _answer(self.account)
        return answer if isinstance(answer, wire.Received) else None

    def failed(self) -> wire.TransferFailed | None:
        answer = _answer(self.account)
        return answer if isinstance(answer, wire.TransferFailed) else None
