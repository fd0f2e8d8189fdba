"""The state transport: how a donor's state reaches the ranks that need it. A plug point: point to point
over the job's authenticated sockets today, striped over several donors across nodes next.

The transport only moves and reports: each side's digests and steps come back as the ranks computed
them, and the incident's transfer step (`job_agent.steps`) checks them into a proof.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

from job_agent import wire
from job_agent.incident import IncidentError
from job_agent.members import Member
from job_agent.waiting import Changes
from torchpass.errors import ErrorType

LISTEN_TIMEOUT = timedelta(seconds=10)
_REPLIES = ("serving", "served", "received", "transfer_failed")
_ENDS = frozenset({"served", "received", "transfer_failed"})


@dataclass(frozen=True)
class Moved:
    """What the donor and each receiver said once the state moved."""

    served: wire.Served
    received: dict[int, wire.Received]


class StateTransport(abc.ABC):
    @abc.abstractmethod
    async def move(
        self,
        donor: Member,
        receivers: Sequence[Member],
        timeout: timedelta,
        progress: Callable[[int], None],
    ) -> Moved:
        """Stream the donor's state to every receiver; `progress(bytes sent)` is called while it streams.
        Raises IncidentError (TransferFailed) when any side fails or is lost."""


def _failed(message: str) -> IncidentError:
    return IncidentError(ErrorType.TRANSFER_FAILED, message)


class DirectTransport(StateTransport):
    """The donor serves on an ephemeral port of the address its node advertises; each receiver connects
    there and streams the state tensor by tensor straight into its own memory (`job_agent.transport`)."""

    def __init__(self, changes: Changes) -> None:
        self._changes = changes
        self._transfers = 0  # numbers each transfer: an answer to an earlier one is never taken for it

    async def move(
        self,
        donor: Member,
        receivers: Sequence[Member],
        timeout: timedelta,
        progress: Callable[[int], None],
    ) -> Moved:
        self._transfers += 1
        tid = self._transfers
        members = [donor, *receivers]
        for m in members:
            for key in _REPLIES:
                m.replies.pop(key, None)
            m.bytes_moved = 0

        def answer(m: Member, *keys: str) -> wire.Frame | None:
            return next(
                (f for k in keys if (f := m.replies.get(k)) is not None and getattr(f, "transfer", 0) == tid),
                None,
            )

        donor.send(wire.Serve(receivers=len(receivers), timeout=timeout.total_seconds(), transfer=tid))
        await self._changes.wait_for(
            lambda: answer(donor, "serving", "transfer_failed") is not None or not donor.alive,
            LISTEN_TIMEOUT,
            "the donor to listen",
        )
        serving = answer(donor, "serving")
        if not isinstance(serving, wire.Serving):
            raise _failed(f"donor rank {donor.slot} did not serve: {self._why(donor, tid)}")
        for r in receivers:
            r.send(
                wire.Receive(
                    host=serving.host,
                    port=serving.port,
                    timeout=timeout.total_seconds(),
                    transfer=tid,
                )
            )

        def finished() -> bool:
            # Every side answered, or one was lost: then the transfer cannot complete, and the step
            # re-plans at once rather than wait out the timeout (the donor stops serving at the next
            # command).
            ends = ("served", "received", "transfer_failed")
            return all(answer(m, *ends) is not None for m in members) or not all(m.alive for m in members)

        await self._changes.wait_for(
            finished, timeout, "the state transfer", lambda: progress(donor.bytes_moved)
        )
        broken = [
            f"{m.slot}: {self._why(m, tid)}"
            for m in members
            if answer(m, "transfer_failed") is not None or not m.alive
        ]
        served = answer(donor, "served")
        received = {r.slot: answer(r, "received") for r in receivers}
        if broken or not isinstance(served, wire.Served):
            raise _failed(f"state transfer failed ({'; '.join(broken) or 'no answer'})")
        return Moved(served, {s: f for s, f in received.items() if isinstance(f, wire.Received)})

    @staticmethod
    def _why(m: Member, tid: int) -> str:
        f = m.replies.get("transfer_failed")
        if isinstance(f, wire.TransferFailed) and f.transfer == tid:
            return f.error
        return "process lost" if not m.alive else "no answer"
