"""The job side of an incident: confirm and fence, reserve a spare, freeze, transfer, rejoin, fall back.

Each step is idempotent for its incident (a retried activity gets the recorded result or redoes the step
from a clean point), every wait is bounded, and every figure it returns is measured from the ranks' own
reports. The workflow decides the order; these only act. They reach the job through `JobControl`.
"""

from __future__ import annotations

import contextlib
import time
from datetime import UTC, datetime, timedelta

from job_agent.coordinator.incident.claims import STALL_MARGIN, disowns, refutes, settle
from job_agent.coordinator.incident.donors import choose_donor, redundancy
from job_agent.coordinator.incident.job_control import JobControl, Tick
from job_agent.coordinator.incident.tracker import Incident, IncidentError
from job_agent.coordinator.incident.transfer_plan import Supplier, mismatch
from job_agent.coordinator.members import Member, MemberState
from job_agent.wire import Freeze
from torchpass.errors import ErrorType
from torchpass.incident.classify import leaving_slots, planned
from torchpass.incident.outcome import MigrationOutcome
from torchpass.incident.proof import resume_problems
from torchpass.incident.steps import (
    ConfirmResult,
    FallbackResult,
    FreezeResult,
    RejoinResult,
    ReserveResult,
    TransferResult,
)
from torchpass.models import Disposition, EventSource, Evidence, FailureKind

FENCE_TIMEOUT = timedelta(seconds=10)
# A failure reported by another source (or forged) names ranks the job still sees: they must show no
# progress for this long before they are fenced (`claims.refutes`).
REFUTE_WAIT = timedelta(seconds=5)
MAX_REGROUPS = 4  # tries to form the group of a recovery, each after a rank lost as it formed


def _since(t0: float) -> float:
    return time.perf_counter() - t0


class IncidentSteps:
    """The recovery steps, run on the coordinator's event loop by the job's activity worker."""

    def __init__(
        self,
        job: JobControl,
        freeze_timeout: timedelta = timedelta(seconds=30),
        transfer_timeout: timedelta = timedelta(seconds=120),
        spare_wait: timedelta = timedelta(seconds=60),
    ) -> None:
        self.job = job
        self.freeze_timeout = freeze_timeout
        self.transfer_timeout = transfer_timeout
        self.supplier = Supplier(job, transfer_timeout, spare_wait)

    def _is_current(self, incident_id: str) -> bool:
        """Whether `incident_id` (workflow id/run id) names the incident the job itself has open."""
        inc = self.job.incidents.current
        return inc is not None and inc.workflow_id == incident_id.split("/", 1)[0]

    def _incident(self, incident_id: str, evidence: tuple[Evidence, ...] = ()) -> Incident:
        workflow_id = incident_id.split("/", 1)[0]
        inc = self.job.incidents.current
        if inc is not None and self._is_current(incident_id):
            return inc
        if inc is None and evidence:
            # Reported by another source (a node watch, NVML): adopt it as this job's incident.
            for ev in evidence:
                self.job.incidents.add(ev)
            inc = self.job.incidents.current
            if inc is not None:
                inc.workflow_id = workflow_id
                inc.answered = True  # its workflow drives it: the job never takes it over
                return inc
        raise IncidentError(
            ErrorType.UNKNOWN_INCIDENT, f"job {self.job.job_id} has no incident {workflow_id}"
        )

    async def confirm(self, incident_id: str, evidence: tuple[Evidence, ...]) -> ConfirmResult:
        t0 = time.perf_counter()
        inc = self.job.incidents.current
        if inc is not None and self._is_current(incident_id) and evidence and evidence[0] not in inc.evidence:
            # A run at the id of the job's own incident that somebody else started: the same failure seen
            # first by another source, or a squatter holding the id with a claim of its own.
            claims = [ev for ev in evidence if ev not in inc.evidence]
            job = self.job
            why = await disowns(
                job.job_id, inc.evidence, inc.lost, claims, job.signed, job.changes, REFUTE_WAIT
            )
            if why is not None:
                moved = self.job.incidents.rekey(inc, f"run {incident_id} is not this job's incident: {why}")
                return self._result(False, (), (), f"refused by the job: {why}; its incident is {moved}", t0)
        if not self._is_current(incident_id):
            # Not an incident the job detected itself: a claim, checked against the job's own view. A
            # planned move of healthy ranks cannot be checked that way: it must be signed.
            unsigned = [ev for ev in evidence if planned(ev) and not self.job.signed(ev)]
            if unsigned:
                slots = sorted({s for ev in unsigned for s in ev.slots})
                why = f"refused by the job: a planned move of rank(s) {slots}, not signed with its secret"
                return self._result(False, (), (), why, t0)
            # As long as the job's own hang detection takes: a claim stands only where the job sees it too.
            wait = max(REFUTE_WAIT, self.job.hang_timeout + STALL_MARGIN)
            refuted = await refutes(self.job.roster, self.job.changes, evidence, wait)
            if refuted is not None:
                return self._result(False, (), (), refuted, t0)
        job, inc = self.job, self._incident(incident_id, evidence)
        inc.leaving |= leaving_slots(inc.evidence)
        fenced = []
        for slot in sorted(inc.lost - inc.leaving):
            for m in list(job.roster.members.values()):
                # Still running (hung), or its connection lost while its process lives on: fence it so it
                # can never rejoin (killing one that already exited does nothing).
                if m.slot == slot and (m.alive or not m.fenced):
                    job.fence(m)
            fenced.append(slot)
        gone = inc.lost - inc.leaving
        await job.changes.wait_for(
            lambda: all(job.roster.at(s) is None for s in gone), FENCE_TIMEOUT, "fenced ranks to die"
        )
        dead = [m.agent_id for m in job.roster.members.values() if m.slot in gone and not m.alive]
        await settle(inc, dead, job.launcher, job.changes)  # a node's word on why they died, delivered
        # Nobody lost but a collective failed with every rank alive: the group re-forms in place.
        confirmed = bool(inc.lost) or any(ev.kind is FailureKind.COLLECTIVE_TIMEOUT for ev in inc.evidence)
        detail = "; ".join(ev.detail for ev in inc.evidence)
        inc.confirmed = frozenset(inc.lost)
        leaving = tuple(sorted(leaving_slots(inc.evidence) & inc.lost))  # still healthy: each its own donor
        return self._result(confirmed, tuple(sorted(inc.lost)), tuple(fenced), detail, t0, leaving)

    def _result(
        self,
        confirmed: bool,
        lost: tuple[int, ...],
        fenced: tuple[int, ...],
        detail: str,
        t0: float,
        leaving: tuple[int, ...] = (),
    ) -> ConfirmResult:
        job, shards = self.job, dict(self.job.roster.shards)
        return ConfirmResult(
            confirmed=confirmed,
            lost_slots=lost,
            fenced_slots=fenced,
            world_size=job.world_size,
            redundancy=redundancy(shards, job.world_size),
            shard_of=shards,
            spares_ready=len(job.spares.ready()),
            spares_warming=job.spares.warming(),
            generation=job.generation,
            covered=job.covered,
            agent=job.spec.agent,
            leaving_slots=leaving,
            batch_host=job.spec.batch_host,
            detail=detail,
            work_seconds=_since(t0),
        )

    async def reserve(self, incident_id: str) -> ReserveResult:
        t0 = time.perf_counter()
        inc = self._incident(incident_id)
        spares = await self.supplier.hold_spares(inc, len(inc.lost))
        return ReserveResult(spare_ids=tuple(m.agent_id for m in spares), work_seconds=_since(t0))

    async def release(self, incident_id: str) -> None:
        self.job.spares.release(self._incident(incident_id).workflow_id)

    async def freeze(self, incident_id: str) -> FreezeResult:
        t0 = time.perf_counter()
        job, inc = self.job, self._incident(incident_id)
        if inc.frozen is not None:
            return inc.frozen
        inc.past_freeze = True
        survivors = [m for m in job.roster.ranks() if m.slot not in inc.lost]
        leaving = [m for m in job.roster.ranks() if m.slot in inc.leaving and not m.fenced]
        # A lost rank may never close its connections (its node hung or cut off): the survivors abandon
        # the group from their side, so that a collective waiting on it fails now, not at its timeout.
        freeze = Freeze(abort=bool(inc.lost - inc.leaving))
        for m in (*survivors, *leaving):
            m.send(freeze)
        if any(m.state is MemberState.JOINING for m in survivors):
            # Lost as a generation formed (the first, at start-up): the others wait for it in a group that
            # can never form; abandoned, they give up at once (not at the store's timeout) and freeze.
            job.abandon(job.generation)
        with contextlib.suppress(TimeoutError):
            await job.changes.wait_for(
                lambda: all(m.state is MemberState.FROZEN or not m.alive for m in (*survivors, *leaving)),
                self.freeze_timeout,
                "ranks to freeze",
            )
        # A survivor lost while freezing, or one that never froze (hung), is one more loss of this
        # recovery: fenced, and its slot goes to a spare like the first one's.
        for m in survivors:
            if m.alive and m.state is not MemberState.FROZEN:
                why = f"rank {m.slot} did not freeze within the freeze timeout"
                self._lose(inc, m, FailureKind.HANG, why)
            elif not m.alive:
                inc.lost.add(m.slot)
        survivors = [m for m in survivors if m.slot not in inc.lost]
        if not survivors:
            raise IncidentError(ErrorType.FREEZE_FAILED, "no rank survived the freeze to give its state")
        # A planned move's leaving ranks froze too: out of the world (spares take their slots), kept until
        # their state has moved, each its own shard's donor. One that did not freeze is fenced now.
        for m in leaving:
            if m.alive and m.state is MemberState.FROZEN:
                m.leaving = True
            else:
                job.fence(m)
        await job.changes.wait_for(
            lambda: all(job.roster.at(m.slot) is None for m in leaving),
            FENCE_TIMEOUT,
            "leaving ranks to stop",
        )
        completed = {m.slot: m.completed for m in survivors}
        _, target = choose_donor(completed)
        inc.frozen = FreezeResult(
            completed_steps=completed,
            target_step=target,
            step_before=job.progress.high_water,
            leaving_steps={m.slot: m.completed for m in job.roster.departing() if m.slot in inc.leaving},
            work_seconds=_since(t0),
        )
        return inc.frozen

    async def transfer(self, incident_id: str, tick: Tick) -> TransferResult:
        t0 = time.perf_counter()
        inc = self._incident(incident_id)
        if inc.proof is not None:
            return TransferResult(proof=inc.proof, work_seconds=0.0)
        inc.proof = await self.supplier.supply(inc, tick)
        await self._dismiss()  # the state has moved: the leaving ranks of a planned move go
        return TransferResult(proof=inc.proof, work_seconds=_since(t0))

    async def _dismiss(self) -> None:
        """Fence the ranks a planned move took out of the world, and wait for them to stop."""
        job, gone = self.job, self.job.roster.departing()
        for m in gone:
            job.fence(m)
        await job.changes.wait_for(
            lambda: not any(m.alive for m in gone), FENCE_TIMEOUT, "leaving ranks to stop"
        )

    def _lose(self, inc: Incident, m: Member, kind: FailureKind, detail: str) -> None:
        """`m` fails during the recovery: fenced, its slot lost, the evidence reported to the incident."""
        self.job.fence(m)
        inc.lost.add(m.slot)
        self.job.add_evidence(
            Evidence(
                kind=kind,
                source=EventSource.COORDINATOR,
                job_id=self.job.job_id,
                failure_domain=m.node,
                slots=(m.slot,),
                detail=detail,
                observed_at=datetime.now(UTC),
            )
        )

    async def rejoin(self, incident_id: str) -> RejoinResult:
        t0 = time.perf_counter()
        inc = self._incident(incident_id)
        if inc.rejoined is not None:
            return inc.rejoined
        if inc.frozen is None:
            raise IncidentError(ErrorType.OUT_OF_ORDER, "rejoin before freeze")
        await self._dismiss()
        resume = inc.frozen.target_step + 1
        reproof = None
        for _ in range(MAX_REGROUPS):
            if inc.proof is not None and any(
                self.job.roster.at(s) is None for s in range(self.job.world_size)
            ):
                # A rank lost after the state moved, or as the group formed: one more loss of this
                # recovery, supplied like the rest, and the group formed again without it.
                inc.proof = reproof = await self.supplier.supply(inc, lambda n: None)
            formed = await self._regroup_and_resume(resume, inc)
            if formed is not None:
                break
        else:
            raise IncidentError(ErrorType.REJOIN_FAILED, f"the group did not form in {MAX_REGROUPS} tries")
        generation, resumed_at = formed
        step_before = inc.frozen.step_before if inc.frozen.step_before is not None else resume - 1
        resumed = dict(self.job.progress.resumed)
        problems = resume_problems(resumed, resume)
        if problems:
            raise mismatch(problems)
        inc.rejoined = RejoinResult(
            generation=generation,
            resumed_step=resume,
            resumed_at=resumed_at,
            resumed_steps=resumed,
            step_before=step_before,
            steps_recomputed=self.job.progress.recomputed_after(step_before),
            proof=reproof,
            work_seconds=_since(t0),
        )
        return inc.rejoined

    async def _regroup_and_resume(
        self, resume: int, inc: Incident | None = None
    ) -> tuple[int, datetime] | None:
        """Form the next generation with every rank and wait for all to train at `resume`. A rank lost
        as it forms: with `inc` (a migration), the generation is abandoned, the others freeze again and
        None says to supply the lost slot and form the group once more; without, the step fails."""
        job = self.job
        ranks = job.roster.ranks()
        if len(ranks) != job.world_size:
            raise IncidentError(ErrorType.REJOIN_FAILED, f"only {len(ranks)} of {job.world_size} ranks alive")
        generation = job.regroup()

        def resumed(m: Member) -> bool:
            return m.state is MemberState.DONE or (m.state is MemberState.TRAINING and m.step >= resume)

        await job.changes.wait_for(
            lambda: all(resumed(m) for m in ranks) or any(not m.alive for m in ranks),
            self.transfer_timeout,
            "every rank to train again",
        )
        lost = [m for m in ranks if not m.alive]
        if lost and inc is not None:
            # The others are blocked forming a group that can never form: the store refuses its keys so
            # they give up at once (not at the store's timeout, which once cost the whole world), and
            # freeze again at the step they hold.
            job.abandon(generation)
            inc.lost.update(m.slot for m in lost)
            survivors = [m for m in ranks if m.alive]
            with contextlib.suppress(TimeoutError):
                await job.changes.wait_for(
                    lambda: all(m.state is MemberState.FROZEN or not m.alive for m in survivors),
                    self.freeze_timeout,
                    "ranks to freeze again",
                )
            for m in survivors:
                if m.alive and m.state is not MemberState.FROZEN:
                    self._lose(inc, m, FailureKind.HANG, f"rank {m.slot} did not freeze again")
            return None
        if lost:
            slots = [m.slot for m in lost]
            raise IncidentError(ErrorType.REJOIN_FAILED, f"ranks {slots} were lost while the group re-formed")
        return generation, datetime.fromtimestamp(max(m.step_wall for m in ranks), UTC)

    async def restart_from_checkpoint(self, incident_id: str, reason: str) -> FallbackResult:
        """The classic path: every rank restarted, the last checkpoint loaded, steps since it redone."""
        t0 = time.perf_counter()
        job, inc = self.job, self._incident(incident_id)
        if inc.fallback is not None:
            return inc.fallback
        if not job.spec.agent and job.restarts >= job.spec.max_restarts:
            why = f"the job was restarted {job.restarts} time(s), its --max-restarts: it fails"
            job.fail(f"{reason}; {why}")
            raise IncidentError(ErrorType.JOB_GONE, why)
        inc.past_freeze = True
        restored_step, path = job.latest_checkpoint()
        for m in (*job.roster.ranks(), *job.roster.departing()):
            job.fence(m)
        await job.changes.wait_for(
            lambda: not job.roster.ranks() and not job.roster.departing(), FENCE_TIMEOUT, "old ranks to die"
        )
        # Read only now: every frame a rank sent before its connection closed has been handled, so no step
        # it completed is missing from what the restart recomputes.
        failed_at = job.progress.high_water
        job.restart_ranks(path)
        await job.changes.wait_for(
            lambda: len(job.roster.ranks(MemberState.READY)) == job.world_size,
            job.startup_timeout,
            "restarted ranks",
        )
        formed = await self._regroup_and_resume(restored_step + 1)
        assert formed is not None  # without an incident, a loss raises
        _, resumed_at = formed
        inc.fallback = FallbackResult(
            restored_step=restored_step,
            failed_at_step=failed_at,
            steps_recomputed=job.progress.recomputed_after(failed_at),
            resumed_at=resumed_at,
            resumed_steps=dict(job.progress.resumed),
            work_seconds=_since(t0),
        )
        return inc.fallback

    async def complete(self, incident_id: str, outcome: MigrationOutcome) -> None:
        job = self.job
        if job.incidents.file(incident_id.split("/", 1)[0], outcome):
            return  # the job handled it itself (`local.py`): its workflow has now filed it
        if any(o.incident_id == outcome.incident_id for o in job.incidents.outcomes):
            return  # a retried completion: already recorded
        if outcome.disposition is Disposition.NOT_A_FAILURE and not self._is_current(incident_id):
            job.end_incident(outcome, refuted=True)  # a claim confirm refuted: recorded, nothing else
            return
        inc = self._incident(incident_id)
        for m in job.roster.departing():  # a recovery that ended before its state moved
            job.fence(m)
        if not inc.completed:
            inc.completed = True
            job.spares.refill(inc.workflow_id)  # a new spare for each one that took a slot, at once
        job.end_incident(outcome)
