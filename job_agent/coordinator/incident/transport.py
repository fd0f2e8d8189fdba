"""The state transport: how the donors' state reaches the ranks that need it. A plug point: over the
job's authenticated sockets, each receiver taking disjoint slices from every donor at once
(striped).

The transport only moves and reports: each side's digests and steps come back as the ranks computed
them, and the incident's transfer step (`job_agent.coordinator.incident.executor`) checks them into
a proof.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

from job_agent import wire
from job_agent.coordinator.answers import TransferAnswers
from job_agent.coordinator.incident.lifecycle import IncidentError
from job_agent.coordinator.members import Member
from job_agent.coordinator.waiting import Changes
from torchpass.errors import ErrorType

LISTEN_TIMEOUT = timedelta(seconds=10)
DONOR_GRACE = timedelta(seconds=5)  # a donor's account, once its receivers have theirs


@dataclass(frozen=True)
class Moved:
    """What the donors and each receiver said once the state moved."""

    # donor slot -> its account, for each donor that finished serving
    served: dict[int, wire.Served]
    received: dict[int, wire.Received]


class StateTransport(abc.ABC):
    @abc.abstractmethod
    async def move(
        self,
        donors: Sequence[Member],
        receivers: Sequence[Member],
        timeout: timedelta,
        progress: Callable[[int], None],
    ) -> Moved:
        """Stream the donors' state (replicas at one step) to every receiver, each taking disjoint
        slices of it from all of them; `progress(bytes sent)` is called while it streams. A donor
        lost on the way is survived while one is left (its slices are taken from the others). Raises
        IncidentError (TransferFailed) when no donor serves or any receiver fails or is lost."""


def _failed(message: str) -> IncidentError:
    return IncidentError(ErrorType.TRANSFER_FAILED, message)


class DirectTransport(StateTransport):
    """Each donor serves on an ephemeral port of the address its node advertises; each receiver
    connects to every donor and streams its slices straight into its own memory
    (`job_agent.transfer.receiver`)."""

    def __init__(self, changes: Changes) -> None:
        self._changes = changes
        # numbers each transfer: an answer to an earlier one is never taken for it
        self._transfers = 0

    async def move(
        self,
        donors: Sequence[Member],
        receivers: Sequence[Member],
        timeout: timedelta,
        progress: Callable[[int], None],
    ) -> Moved:
        self._transfers += 1
        tid = self._transfers
        # this transfer's
        answers = {m.agent_id: TransferAnswers(tid) for m in (*donors, *receivers)}
        for m in (*donors, *receivers):
            m.answers, m.bytes_moved = answers[m.agent_id], 0

        def ended(m: Member) -> bool:
            return answers[m.agent_id].account.done() or not m.alive

        for d in donors:
            d.send(
                wire.Serve(receivers=len(receivers), timeout=timeout.total_seconds(), transfer=tid)
            )
        with contextlib.suppress(TimeoutError):  # a donor that never listens is left out
            await self._changes.wait_for(
                lambda: all(answers[d.agent_id].listening.done() or not d.alive for d in donors),
                LISTEN_TIMEOUT,
                "the donors to listen",
            )
        serving = [(d, s) for d in donors if (s := answers[d.agent_id].serving()) is not None]
        if not serving:
            why = "; ".join(f"{d.slot}: {_why(d, answers[d.agent_id])}" for d in donors)
            raise _failed(f"no donor served: {why}")
        sources = tuple(wire.Source(slot=d.slot, host=s.host, port=s.port) for d, s in serving)
        for r in receivers:
            r.send(wire.Receive(sources=sources, timeout=timeout.total_seconds(), transfer=tid))

        def finished() -> bool:
            # A receiver lost or failed: the transfer cannot complete, and the step re-plans at once
            # rather than wait out the timeout (a donor still serving stops at the next command). A
            # donor lost meanwhile only loses its slices to the others.
            return all(ended(r) for r in receivers) or any(not r.alive for r in receivers)

        await self._changes.wait_for(
            finished,
            timeout,
            "the state transfer",
            lambda: progress(sum(d.bytes_moved for d in donors)),
        )
        # each donor's account follows its receivers' at once
        with contextlib.suppress(TimeoutError):
            await self._changes.wait_for(
                lambda: all(ended(d) for d, _ in serving), DONOR_GRACE, "the donors' accounts"
            )
        broken = [
            f"{m.slot}: {_why(m, answers[m.agent_id])}"
            for m in receivers
            if answers[m.agent_id].failed() is not None or not m.alive
        ]
        if broken:
            raise _failed(f"state transfer failed ({'; '.join(broken)})")
        served = {d.slot: a for d, _ in serving if (a := answers[d.agent_id].served()) is not None}
        if not served:
            raise _failed("no donor finished serving")
        received = {
            r.slot: g for r in receivers if (g := answers[r.agent_id].received()) is not None
        }
        return Moved(served, received)


def _why(m: Member, answers: TransferAnswers) -> str:
    failed = answers.failed()
    if failed is not None:
        return failed.error
    return "process lost" if not m.alive else "no answer"
