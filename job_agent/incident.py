"""The job side of an incident: confirm and fence, reserve a spare, freeze, transfer, rejoin, fall back.

Each action is idempotent for its incident (a retried activity gets the recorded result or redoes the
step from a clean point) and every wait is bounded. The workflow decides the order; these only act.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from job_agent.members import Member
from job_agent.recovery import choose_donor, receivers
from torchpass.classify import CATEGORY_OF
from torchpass.errors import ErrorType, TorchpassError
from torchpass.models import (
    Category,
    ConfirmResult,
    Evidence,
    FailureKind,
    FallbackResult,
    FreezeResult,
    MigrationOutcome,
    RejoinResult,
    ReserveResult,
    TransferProof,
    TransferResult,
)

if TYPE_CHECKING:
    from job_agent.coordinator import Coordinator


class IncidentError(TorchpassError):
    """A step of the incident failed; its `error_type` decides whether trying again can help."""

    def __init__(self, error_type: ErrorType, message: str) -> None:
        super().__init__(message, error_type)


@dataclass
class Incident:
    """What the coordinator remembers of the incident in progress."""

    workflow_id: str
    evidence: list[Evidence] = field(default_factory=list)
    lost: set[int] = field(default_factory=set)
    leaving: set[int] = field(default_factory=set)  # planned: healthy until frozen, then fenced
    spare_ids: list[str] = field(default_factory=list)
    past_freeze: bool = False
    frozen: FreezeResult | None = None
    proof: TransferProof | None = None
    rejoined: RejoinResult | None = None
    fallback: FallbackResult | None = None
    completed: bool = False


Tick = Callable[[], None]


class IncidentActions:
    """The recovery steps, run on the coordinator's event loop by the job's activity worker."""

    def __init__(
        self,
        coordinator: Coordinator,
        freeze_timeout: float = 30.0,
        transfer_timeout: float = 120.0,
        spare_wait: float = 60.0,
    ) -> None:
        self.c = coordinator
        self.spare_wait = spare_wait
        self.freeze_timeout = freeze_timeout
        self.transfer_timeout = transfer_timeout

    def _incident(self, incident_id: str, evidence: tuple[Evidence, ...] = ()) -> Incident:
        workflow_id = incident_id.split("/", 1)[0]
        inc = self.c.incident
        if inc is not None and inc.workflow_id == workflow_id:
            return inc
        if inc is None and evidence:
            # Reported by another source (a node watch, NVML): adopt it as this job's incident.
            for ev in evidence:
                self.c.add_evidence(ev)
            inc = self.c.incident
            if inc is not None:
                inc.workflow_id = workflow_id
                return inc
        raise IncidentError(ErrorType.UNKNOWN_INCIDENT, f"job {self.c.job_id} has no incident {workflow_id}")

    async def confirm(self, incident_id: str, evidence: tuple[Evidence, ...]) -> ConfirmResult:
        t0 = time.perf_counter()
        inc = self._incident(incident_id, evidence)
        fenced = []
        inc.leaving |= _planned_slots(inc)
        for slot in sorted(inc.lost - inc.leaving):
            m = self.c.member_at(slot)
            if m is not None:  # still running (hung): fence it so it can never rejoin
                m.fenced = True
                self.c.kill(m)
            fenced.append(slot)
        await self.c.wait_for(
            lambda: all(self.c.member_at(s) is None for s in inc.lost - inc.leaving),
            10.0,
            "fenced ranks to die",
        )
        return ConfirmResult(
            # Nobody lost but a collective failed with every rank alive: the group re-forms in place.
            confirmed=bool(inc.lost) or any(ev.kind is FailureKind.COLLECTIVE_TIMEOUT for ev in inc.evidence),
            lost_slots=tuple(sorted(inc.lost)),
            fenced_slots=tuple(fenced),
            world_size=self.c.world_size,
            redundancy=self.c.world_size,  # pure data parallelism: every rank is a full replica
            generation=self.c.generation,
            covered=self.c.spec.contract is not None,
            detail="; ".join(ev.detail for ev in inc.evidence),
            work_seconds=time.perf_counter() - t0,
        )

    async def reserve(self, incident_id: str) -> ReserveResult:
        t0 = time.perf_counter()
        inc = self._incident(incident_id)
        if not inc.spare_ids:
            need = len(inc.lost)
            # A spare still warming up (the pool refills after each migration) is worth a few seconds'
            # wait: far cheaper than a checkpoint restart.
            with contextlib.suppress(TimeoutError):
                await self.c.wait_for(
                    lambda: len(self.c.spares()) >= need or self.c.starting_spares() == 0,
                    self.spare_wait,
                    "a warm spare",
                )
            free = self.c.spares()
            if len(free) < need:
                raise IncidentError(ErrorType.NO_SPARE, f"{len(inc.lost)} spare(s) needed, {len(free)} warm")
            for m in free[: len(inc.lost)]:
                m.reserved_for = inc.workflow_id
                inc.spare_ids.append(m.agent_id)
        return ReserveResult(spare_ids=tuple(inc.spare_ids), work_seconds=time.perf_counter() - t0)

    async def release(self, incident_id: str) -> None:
        inc = self._incident(incident_id)
        for agent_id in inc.spare_ids:
            m = self.c.members.get(agent_id)
            if m is None or not m.alive:
                continue
            if m.slot >= 0 or m.state != "ready":
                # It was already given a slot or state: not clean enough to wait as a spare again.
                m.fenced = True
                self.c.kill(m)
                self.c.spawn("spare", -1)
            else:
                m.reserved_for = None
        inc.spare_ids.clear()

    async def freeze(self, incident_id: str) -> FreezeResult:
        t0 = time.perf_counter()
        inc = self._incident(incident_id)
        if inc.frozen is not None:
            return inc.frozen
        inc.past_freeze = True
        survivors = [m for m in self.c.ranks() if m.slot not in inc.lost and m.role == "rank"]
        leaving = [m for m in self.c.ranks() if m.slot in inc.leaving and not m.fenced]
        for m in (*survivors, *leaving):
            m.send({"t": "freeze"})
        await self.c.wait_for(
            lambda: all(m.state == "frozen" or not m.alive for m in (*survivors, *leaving)),
            self.freeze_timeout,
            "ranks to freeze",
        )
        gone = [m.slot for m in survivors if not m.alive]
        if gone:
            raise IncidentError(ErrorType.FREEZE_FAILED, f"ranks {gone} were lost while freezing")
        await self._fence_leaving(leaving)
        completed = {m.slot: m.completed for m in survivors}
        _, target = choose_donor(completed)
        inc.frozen = FreezeResult(
            completed_steps=completed, target_step=target, work_seconds=time.perf_counter() - t0
        )
        return inc.frozen

    async def _fence_leaving(self, leaving: list[Member]) -> None:
        """A planned move: the leaving ranks froze with everyone else; now they go, for good."""
        for m in leaving:
            m.fenced = True
            self.c.kill(m)
        await self.c.wait_for(
            lambda: all(self.c.member_at(m.slot) is None for m in leaving), 10.0, "leaving ranks to stop"
        )

    async def transfer(self, incident_id: str, tick: Tick) -> TransferResult:
        t0 = time.perf_counter()
        inc = self._incident(incident_id)
        if inc.proof is not None:
            return TransferResult(proof=inc.proof, work_seconds=0.0)
        if inc.frozen is None:
            raise IncidentError(ErrorType.OUT_OF_ORDER, "transfer before freeze")
        completed = dict(inc.frozen.completed_steps)
        donor_slot, target = choose_donor(completed)
        new = self._assign_spares(inc)
        targets = receivers(completed, target, frozenset(new))
        donor = self._member(donor_slot)
        members = [donor, *(self._member(s) for s in targets)]
        for m in members:
            for key in ("serving", "served", "received", "transfer_failed"):
                m.replies.pop(key, None)
        donor.send({"t": "serve", "receivers": len(targets), "timeout": self.transfer_timeout})
        await self.c.wait_for(
            lambda: bool({"serving", "transfer_failed"} & donor.replies.keys()), 10.0, "the donor to listen"
        )
        port = donor.replies.get("serving", {}).get("port")
        for slot in targets:
            self._member(slot).send(
                {"t": "receive", "host": "127.0.0.1", "port": port, "timeout": self.transfer_timeout}
            )

        def finished() -> bool:
            return all(
                {"served", "received", "transfer_failed"} & m.replies.keys() or not m.alive for m in members
            )

        await self.c.wait_for(finished, self.transfer_timeout, "the state transfer", tick)
        failed = [
            f"{m.slot}: {m.replies['transfer_failed']['error']}"
            for m in members
            if "transfer_failed" in m.replies
        ]
        if failed or not all(m.alive for m in members):
            raise IncidentError(
                ErrorType.TRANSFER_FAILED, f"state transfer failed ({'; '.join(failed) or 'peer lost'})"
            )
        donor_digest = donor.replies["served"]["digest"]
        got = {s: self._member(s).replies["received"]["digest"] for s in targets}
        if any(d != donor_digest for d in got.values()):
            raise IncidentError(
                ErrorType.TRANSFER_FAILED, f"digest mismatch: donor {donor_digest}, receivers {got}"
            )
        inc.proof = TransferProof(
            donor_slot=donor_slot,
            receiver_slots=tuple(targets),
            donor_digest=donor_digest,
            receiver_digests=got,
            step_before=max(completed.values()),
            step_after=target,
            bytes=int(donor.replies["served"]["bytes"]),
            seconds=float(donor.replies["served"]["seconds"]),
            stream_seconds=donor.replies["served"].get("stream_seconds"),
        )
        return TransferResult(proof=inc.proof, work_seconds=time.perf_counter() - t0)

    def _assign_spares(self, inc: Incident) -> dict[int, Member]:
        """Give each lost slot one reserved spare: the newcomer takes the dead rank's exact place."""
        spares = [self.c.members[a] for a in inc.spare_ids]
        new = dict(zip(sorted(inc.lost), spares, strict=True))
        for slot, m in new.items():
            m.slot, m.role = slot, "rank"
            m.send({"t": "assign", "slot": slot})
        return new

    def _member(self, slot: int) -> Member:
        m = self.c.member_at(slot)
        if m is None:
            raise IncidentError(ErrorType.TRANSFER_FAILED, f"no live process holds slot {slot}")
        return m

    async def rejoin(self, incident_id: str) -> RejoinResult:
        t0 = time.perf_counter()
        inc = self._incident(incident_id)
        if inc.rejoined is not None:
            return inc.rejoined
        if inc.frozen is None:
            raise IncidentError(ErrorType.OUT_OF_ORDER, "rejoin before freeze")
        resume = inc.frozen.target_step + 1
        generation, resumed_at = await self._regroup_and_resume(resume, self.transfer_timeout)
        inc.rejoined = RejoinResult(
            generation=generation,
            resumed_step=resume,
            resumed_at=resumed_at,
            work_seconds=time.perf_counter() - t0,
        )
        return inc.rejoined

    async def _regroup_and_resume(self, resume: int, timeout: float) -> tuple[int, datetime]:
        if len(self.c.ranks()) != self.c.world_size:
            raise IncidentError(
                ErrorType.REJOIN_FAILED, f"only {len(self.c.ranks())} of {self.c.world_size} ranks alive"
            )
        generation = self.c.regroup()
        ranks = self.c.ranks()

        def resumed(m: Member) -> bool:
            return m.state == "done" or (m.state == "training" and m.step >= resume)

        await self.c.wait_for(lambda: all(resumed(m) for m in ranks), timeout, "every rank to train again")
        last = max(m.step_wall for m in ranks)
        return generation, datetime.fromtimestamp(last, UTC)

    async def restart_from_checkpoint(self, incident_id: str, reason: str) -> FallbackResult:
        """The classic path: every rank restarted, the last checkpoint loaded, steps since it redone."""
        t0 = time.perf_counter()
        inc = self._incident(incident_id)
        if inc.fallback is not None:
            return inc.fallback
        inc.past_freeze = True
        failed_at = max((m.completed for m in self.c.members.values() if m.slot >= 0), default=-1)
        restored_step, path = self.c.checkpoints[-1] if self.c.checkpoints else (-1, None)
        for m in self.c.ranks():
            m.fenced = True
            self.c.kill(m)
        await self.c.wait_for(lambda: not self.c.ranks(), 10.0, "old ranks to die")
        for slot in range(self.c.world_size):
            self.c.spawn("rank", slot, restore=path)
        await self.c.wait_for(
            lambda: len(self.c.ranks("ready")) == self.c.world_size,
            self.c.spec.startup_timeout,
            "restarted ranks",
        )
        _, resumed_at = await self._regroup_and_resume(restored_step + 1, self.transfer_timeout)
        inc.fallback = FallbackResult(
            restored_step=restored_step,
            failed_at_step=failed_at,
            steps_recomputed=max(0, failed_at - restored_step),
            resumed_at=resumed_at,
            work_seconds=time.perf_counter() - t0,
        )
        return inc.fallback

    async def complete(self, incident_id: str, outcome: MigrationOutcome) -> None:
        if any(o.incident_id == outcome.incident_id for o in self.c.incidents):
            return  # a retried completion: already recorded
        inc = self._incident(incident_id)
        if not inc.completed:
            inc.completed = True
            for agent_id in inc.spare_ids:
                if self.c.members[agent_id].slot >= 0:
                    self.c.spawn("spare", -1)  # refill the pool at once
        self.c.end_incident(outcome)


def _planned_slots(inc: Incident) -> set[int]:
    """Slots whose every report is a planned signal (cordon, drain): their ranks are healthy donors."""
    planned = {s for ev in inc.evidence if CATEGORY_OF[ev.kind] is Category.PLANNED for s in ev.slots}
    failed = {s for ev in inc.evidence if CATEGORY_OF[ev.kind] is not Category.PLANNED for s in ev.slots}
    return planned - failed
