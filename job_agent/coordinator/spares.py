"""The spare pool: processes ready to take a lost rank's slot. A plug point: warm local processes
today, Kubernetes or Slurm spare nodes next.

A reservation is held for one incident (idempotent: asking again returns the same spares), given
back by `release` when a later step fails, and `refill` starts a new spare for every one that took a
slot.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable, Collection

from job_agent.coordinator.members import Member, Roster
from job_agent.wire.operator import MemberState
from job_agent.wire.rank import Role

log = logging.getLogger("torchpass.spares")
MAX_FAILED_STARTS = 3
SPARE_HINT = (
    "a spare runs the script before it holds a slot: agent.rank is -1 there and the placeholder "
    "group says rank 0, so build what needs a rank from dist.get_rank() or leave it to the agent, "
    "as a DistributedSampler's"
)


class SparePool(abc.ABC):
    @abc.abstractmethod
    def ready(self) -> list[Member]:
        """Spares warm (model built, memory touched) and not reserved."""

    @abc.abstractmethod
    def warming(self) -> int:
        """Spares launched but not yet warm: worth a short wait before giving up on a migration."""

    @abc.abstractmethod
    def held(self, incident: str) -> list[Member]:
        """What `incident` holds: spares reserved for it, including those that already took a
        slot."""

    @abc.abstractmethod
    def reserve(
        self, incident: str, n: int, near: Collection[str] = (), then: Collection[str] = ()
    ) -> list[Member]:
        """Up to `n` live spares, held for `incident` (those it already holds first, then those on
        the nodes `near`: a lost rank's own node; then those on the nodes `then`: spare nodes)."""

    @abc.abstractmethod
    def release(self, incident: str) -> None:
        """Give back what `incident` holds; a spare already given a slot or state is replaced."""

    @abc.abstractmethod
    def refill(self, incident: str) -> None:
        """The incident is done: start a new spare for each of its spares that took a slot."""

    @abc.abstractmethod
    def lost(self, m: Member, warm: bool) -> None:
        """A spare process died, once `warm` or before: replace it (the latter within a bound)."""

    @abc.abstractmethod
    def failed_start(self, agent_id: str, code: int | None) -> None:
        """A spare died before it ever joined (`code`) or became warm: replace it, within a bound
        (never fatal to the job)."""

    @abc.abstractmethod
    def started(self, m: Member) -> None:
        """A spare is warm: its start succeeded."""


class LocalSparePool(SparePool):
    """Warm spare processes on this host, launched like the ranks (`spawn`) and fenced with
    `kill`."""

    def __init__(
        self,
        roster: Roster,
        spawn: Callable[[], object],
        kill: Callable[[Member], None],
        avoid: Collection[str] = (),
    ) -> None:
        self._roster = roster
        self._avoid = avoid  # nodes cordoned, drained or lost: a spare there takes no slot
        self._start = spawn
        self._kill = kill
        self._failed_starts = 0  # in a row, since the last spare that came up warm

    def _spawn(self) -> None:
        """One more spare, where one can start: none can while every node agent is gone."""
        try:
            self._start()
        except RuntimeError as e:
            log.warning("no spare started: %s", e)

    def _spares(self) -> list[Member]:
        return [m for m in self._roster.members.values() if m.role is Role.SPARE and m.alive]

    def ready(self) -> list[Member]:
        return [
            m
            for m in self._spares()
            if m.state is MemberState.READY and m.reserved_for is None and m.node not in self._avoid
        ]

    def warming(self) -> int:
        connecting = [m for m in self._spares() if m.state is MemberState.CONNECTED]
        launched = self._roster.pending.values()
        return len(connecting) + sum(1 for p in launched if p.role is Role.SPARE)

    def held(self, incident: str) -> list[Member]:
        return [m for m in self._roster.members.values() if m.reserved_for == incident]

    def reserve(
        self, incident: str, n: int, near: Collection[str] = (), then: Collection[str] = ()
    ) -> list[Member]:
        held = [m for m in self.held(incident) if m.alive]  # one lost on the way is replaced
        # Stable: the pool's order otherwise.
        ready = sorted(self.ready(), key=lambda m: (m.node not in near, m.node not in then))
        for m in ready[: max(0, n - len(held))]:
            m.reserved_for = incident
            held.append(m)
        return held

    def release(self, incident: str) -> None:
        for m in self.held(incident):
            m.reserved_for = None
            if not m.alive:
                continue
            if m.role is not Role.SPARE or m.state is not MemberState.READY:
                # It was already given a slot or state: not clean enough to wait as a spare again.
                m.fenced = True
                self._kill(m)
                self._spawn()

    def refill(self, incident: str) -> None:
        for m in self.held(incident):
            m.reserved_for = None
            if m.role is Role.RANK:
                self._spawn()

    def lost(self, m: Member, warm: bool) -> None:
        if not warm:  # it died before it was warm: its start failed
            self.failed_start(m.agent_id, None)
        else:
            self._spawn()

    def failed_start(self, agent_id: str, code: int | None) -> None:
        how = (
            f"exited (code {code}) before joining"
            if code is not None
            else "exited before it was warm"
        )
        how += f" (its output is above; {SPARE_HINT})"
        self._failed_starts += 1
        if self._failed_starts > MAX_FAILED_STARTS:
            log.error(
                "spare %s %s; %d spares in a row did: not starting more until one "
                "comes up (the job goes on, a failure now falls back to a restart)",
                agent_id,
                how,
                self._failed_starts,
            )
            return
        log.warning("spare %s %s; starting another", agent_id, how)
        self._spawn()

    def started(self, m: Member) -> None:
        self._failed_starts = 0
