"""Operator requests to a running job: failure injection (tests, demos, chaos) and planned
migration.

`torchpass inject kill|hang|pause` fires when the rank reaches the given step; `torchpass drain`
turns a cordon or drain into planned-migration evidence while the rank is still healthy (it is
fenced only once every rank froze, by the incident's freeze step).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import UTC, datetime

from job_agent import wire
from job_agent.coordinator.members import Member, Roster
from job_agent.launch.launcher import Launcher
from job_agent.wire.operator import InjectAction, InjectTarget
from job_agent.wire.rank import Role
from torchpass.errors import ErrorType
from torchpass.models import EventSource, Evidence, FailureKind


def _refused(reason: str) -> wire.Error:
    return wire.Error(code=ErrorType.REFUSED, reason=reason)


class Injector:
    def __init__(self, job_id: str, world_size: int, roster: Roster, launcher: Launcher) -> None:
        self._job_id = job_id
        self._world = world_size
        self._roster = roster
        self._launcher = launcher
        self._armed: list[wire.Inject] = []

    def _no_such_rank(self, slot: int) -> wire.Error:
        return _refused(f"job {self._job_id} has ranks 0-{self._world - 1}, not {slot!r}")

    def inject(self, req: wire.Inject) -> wire.Ok | wire.Error:
        if req.target is InjectTarget.SPARE:
            return self._hit_spare(req)
        if req.slot >= self._world:
            return self._no_such_rank(req.slot)
        self._armed.append(req)
        m = self._roster.at(req.slot)
        if m is not None:
            self.on_step(m)
        detail = {
            "action": req.action.value,
            "slot": req.slot,
            "after_step": req.after_step,
            "during": req.during,
            "target": req.target.value,
        }
        return wire.Ok(detail=detail)

    def _hit_spare(self, req: wire.Inject) -> wire.Ok | wire.Error:
        """A spare process, at once: one still starting up if any (the case that once failed the
        whole job), else a warm one nobody holds. The pool replaces it; nothing is migrated."""
        starting = sorted(a for a, p in self._roster.pending.items() if p.role is Role.SPARE)
        warm = sorted(
            m.agent_id
            for m in self._roster.members.values()
            if m.role is Role.SPARE and m.alive and m.reserved_for is None
        )
        if not starting and not warm:
            return _refused(f"job {self._job_id} has no spare to hit")
        agent_id = (starting or warm)[0]
        if req.action is InjectAction.KILL:
            self._launcher.kill(agent_id)
        else:
            self._launcher.suspend(agent_id)
            if req.action is InjectAction.PAUSE:
                asyncio.get_running_loop().call_later(req.seconds, self._launcher.resume, agent_id)
        state = "starting" if starting else "warm"
        return wire.Ok(
            detail={"action": req.action.value, "target": "spare", "agent": agent_id, "was": state}
        )

    def drain(self, req: wire.Drain, state: str) -> tuple[wire.Ok | wire.Error, Evidence | None]:
        """A planned migration (node cordon or drain, security patch, rising temperature)."""
        m = self._roster.at(req.slot)
        if m is None or m.role is not Role.RANK:
            return self._no_such_rank(req.slot), None
        if state != "training":
            return _refused(f"job {self._job_id} is {state}, not training"), None
        kind = FailureKind.NODE_CORDON if req.kind == "cordon" else FailureKind.NODE_DRAIN
        ev = Evidence(
            kind=kind,
            source=EventSource.OPERATOR,
            job_id=self._job_id,
            failure_domain=m.node,
            slots=(m.slot,),
            detail=f"planned migration of rank {m.slot} off {m.node}: "
            f"{req.reason or 'operator request'}",
            observed_at=datetime.now(UTC),
        )
        return wire.Ok(detail={"slot": m.slot, "node": m.node}), ev

    def on_step(self, m: Member) -> None:
        """Fire the injections armed for `m`'s slot that its step has reached."""
        for req in list(self._armed):
            if req.during != "step" or req.slot != m.slot:
                continue
            if req.after_step is not None and m.step < req.after_step:
                continue
            self._armed.remove(req)
            self._fire(req, m)

    def on_transfer(self, donor: Member, receivers: Sequence[Member]) -> None:
        """A state transfer is about to start: fire the injections armed for it (one per transfer;
        with `after_step`, only once the world has completed that step)."""
        for req in list(self._armed):
            if req.during != "transfer" or (
                req.after_step is not None and donor.completed < req.after_step
            ):
                continue
            if req.target is InjectTarget.DONOR:
                m: Member | None = donor
            elif req.target is InjectTarget.RECEIVER:
                m = receivers[0] if receivers else None
            else:
                m = self._roster.at(req.slot)
            if m is not None:
                self._armed.remove(req)
                self._fire(req, m)
                return

    def on_regroup(self) -> None:
        """A recovery's group is about to form: fire the injections armed for it (with `after_step`,
        only once the rank has completed that step)."""
        for req in list(self._armed):
            m = self._roster.at(req.slot)
            if req.during != "regroup" or m is None:
                continue
            if req.after_step is not None and m.completed < req.after_step:
                continue
            self._armed.remove(req)
            self._fire(req, m)

    def _fire(self, req: wire.Inject, m: Member) -> None:
        if req.action is InjectAction.KILL:
            self._launcher.kill(m.agent_id)
            return
        self._launcher.suspend(m.agent_id)
        if req.action is InjectAction.PAUSE:  # a stall that ends: the rank resumes on its own
            asyncio.get_running_loop().call_later(req.seconds, self._launcher.resume, m.agent_id)
