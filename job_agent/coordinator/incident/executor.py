"""The job side of an incident: confirm and fence (`confirm.py`), reserve spares, freeze, transfer,
rejoin, fall back.

Each step is idempotent for its incident (a retried activity gets the recorded result or redoes the
step from a clean point), every wait is bounded, and every figure it returns is measured from the
ranks' own reports. The workflow decides the order; these only act. They reach the job through
`JobControl`.
"""

from __future__ import annotations

import contextlib
import time
from datetime import UTC, datetime, timedelta

from job_agent.coordinator.incident.confirm import FENCE_TIMEOUT, confirm, incident_of, is_current
from job_agent.coordinator.incident.donors import choose_donor
from job_agent.coordinator.incident.exactness import inexact, verdicts
from job_agent.coordinator.incident.job_control import JobControl, Tick, work_seconds
from job_agent.coordinator.incident.lifecycle import Incident, IncidentError, IncidentState
from job_agent.coordinator.incident.transfer_plan import TransferPlanner, mismatch
from job_agent.coordinator.members import Member
from job_agent.wire.operator import MemberState
from job_agent.wire.rank import Freeze
from torchpass.errors import ErrorType
from torchpass.incident.outcome import MigrationOutcome
from torchpass.incident.proof import resume_problems
from torchpass.incident.steps import (
    ConfirmResult,
    FallbackResult,
    FreezeResult,
    IncidentRef,
    RejoinResult,
    ReserveResult,
    TransferResult,
)
from torchpass.models import Disposition, EventSource, Evidence, FailureKind

MAX_REGROUPS = 4  # tries to form the group of a recovery, each after a rank lost as it formed


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
        self.planner = TransferPlanner(job, transfer_timeout, spare_wait)

    async def confirm(self, ref: IncidentRef, evidence: tuple[Evidence, ...]) -> ConfirmResult:
        return await confirm(self.job, ref, evidence)

    async def reserve(self, ref: IncidentRef) -> ReserveResult:
        t0 = time.perf_counter()
        inc = incident_of(self.job, ref)
        spares = await self.planner.hold_spares(inc, len(inc.lost))
        return ReserveResult(
            spare_ids=tuple(m.agent_id for m in spares), work_seconds=work_seconds(t0)
        )

    async def release(self, ref: IncidentRef) -> None:
        self.job.spares.release(incident_of(self.job, ref).workflow_id)

    async def freeze(self, ref: IncidentRef) -> FreezeResult:
        t0 = time.perf_counter()
        job, inc = self.job, incident_of(self.job, ref)
        if inc.frozen is not None:
            return inc.frozen
        inc.move(IncidentState.FREEZING)
        survivors = [m for m in job.roster.ranks() if m.slot not in inc.lost]
        leaving = [m for m in job.roster.ranks() if m.slot in inc.leaving and not m.fenced]
        # A lost rank may never close its connections (its node hung or cut off): the survivors
        # abandon the group from their side, so that a collective waiting on it fails now, not at
        # its timeout.
        freeze = Freeze(abort=bool(inc.lost - inc.leaving))
        for m in (*survivors, *leaving):
            m.send(freeze)
        if any(m.state is MemberState.JOINING for m in survivors):
            # Lost as a generation formed (the first, at start-up): the others wait for it in a
            # group that can never form; abandoned, they give up at once (not at the store's
            # timeout) and freeze.
            job.abandon(job.generation)
        with contextlib.suppress(TimeoutError):
            await job.changes.wait_for(
                lambda: all(
                    m.state is MemberState.FROZEN or not m.alive for m in (*survivors, *leaving)
                ),
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
            raise IncidentError(
                ErrorType.FREEZE_FAILED, "no rank survived the freeze to give its state"
            )
        # A planned move's leaving ranks froze too: out of the world (spares take their slots), kept
        # until their state has moved, each its own shard's donor. One that did not freeze is fenced
        # now.
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
            leaving_steps={
                m.slot: m.completed for m in job.roster.departing() if m.slot in inc.leaving
            },
            work_seconds=work_seconds(t0),
        )
        inc.move(IncidentState.FROZEN)
        return inc.frozen

    async def transfer(self, ref: IncidentRef, tick: Tick) -> TransferResult:
        t0 = time.perf_counter()
        inc = incident_of(self.job, ref)
        if inc.proof is not None:
            return TransferResult(proof=inc.proof, work_seconds=0.0)
        inc.allows(IncidentState.MOVED)
        inc.proof = await self.planner.transfer(inc, tick)
        inc.move(IncidentState.MOVED)
        await self._dismiss()  # the state has moved: the leaving ranks of a planned move go
        return TransferResult(proof=inc.proof, work_seconds=work_seconds(t0))

    async def _dismiss(self) -> None:
        """Fence the ranks a planned move took out of the world, and wait for them to stop."""
        job, gone = self.job, self.job.roster.departing()
        for m in gone:
            job.fence(m)
        await job.changes.wait_for(
            lambda: not any(m.alive for m in gone), FENCE_TIMEOUT, "leaving ranks to stop"
        )

    def _lose(self, inc: Incident, m: Member, kind: FailureKind, detail: str) -> None:
        """`m` fails during the recovery: fenced, its slot lost, the evidence reported to the
        incident."""
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

    async def rejoin(self, ref: IncidentRef) -> RejoinResult:
        t0 = time.perf_counter()
        inc = incident_of(self.job, ref)
        if inc.rejoined is not None:
            return inc.rejoined
        inc.allows(IncidentState.TRAINING)
        assert inc.frozen is not None  # the state moved: it was frozen
        await self._dismiss()
        resume = inc.frozen.target_step + 1
        reproof = None
        for _ in range(MAX_REGROUPS):
            if inc.proof is not None and any(
                self.job.roster.at(s) is None for s in range(self.job.world_size)
            ):
                # A rank lost after the state moved, or as the group formed: one more loss of this
                # recovery, supplied like the rest, and the group formed again without it.
                inc.proof = reproof = await self.planner.transfer(inc, lambda n: None)
                inc.move(IncidentState.MOVED)
            formed = await self._regroup_and_resume(resume, inc)
            if formed is not None:
                break
        else:
            raise IncidentError(
                ErrorType.REJOIN_FAILED, f"the group did not form in {MAX_REGROUPS} tries"
            )
        generation, resumed_at = formed
        await verdicts(self.job.changes, self.job.roster.ranks(), resume)
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
            work_seconds=work_seconds(t0),
            inexact=inexact(self.job.roster, inc.proof, resume),
        )
        inc.move(IncidentState.TRAINING)
        return inc.rejoined

    async def _regroup_and_resume(
        self, resume: int, inc: Incident | None = None, unmeasured: bool = False
    ) -> tuple[int, datetime] | None:
        """Form the next generation with every rank and wait for all to train at `resume`. A rank
        lost as it forms: with `inc` (a migration), the generation is abandoned, the others freeze
        again and None says to supply the lost slot and form the group once more; without, the step
        fails. `unmeasured`: the job never reported a step (an unmodified script stepping no
        `torch.optim` optimizer), so a rank trains again once it joined the new generation."""
        job = self.job
        ranks = job.roster.ranks()
        if len(ranks) != job.world_size:
            raise IncidentError(
                ErrorType.REJOIN_FAILED, f"only {len(ranks)} of {job.world_size} ranks alive"
            )
        generation = job.regroup()

        def resumed(m: Member) -> bool:
            if unmeasured and m.state is MemberState.JOINED:
                return True
            return m.state is MemberState.DONE or (
                m.state is MemberState.TRAINING and m.step >= resume
            )

        await job.changes.wait_for(
            lambda: all(resumed(m) for m in ranks) or any(not m.alive for m in ranks),
            self.transfer_timeout,
            "every rank to train again",
        )
        lost = [m for m in ranks if not m.alive]
        if lost and inc is not None:
            # The others are blocked forming a group that can never form: the store refuses its keys
            # so they give up at once (not at the store's timeout, which once cost the whole world),
            # and freeze again at the step they hold.
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
            raise IncidentError(
                ErrorType.REJOIN_FAILED, f"ranks {slots} were lost while the group re-formed"
            )
        if unmeasured:  # no step to take the time from: when they had all joined
            return generation, datetime.now(UTC)
        return generation, datetime.fromtimestamp(max(m.step_wall for m in ranks), UTC)

    async def restart_from_checkpoint(self, ref: IncidentRef, reason: str) -> FallbackResult:
        """The classic path: every rank restarted, the last checkpoint loaded, steps since it
        redone."""
        t0 = time.perf_counter()
        job, inc = self.job, incident_of(self.job, ref)
        if inc.fallback is not None:
            return inc.fallback
        if not job.spec.agent and job.restarts >= job.spec.max_restarts:
            why = f"the job was restarted {job.restarts} time(s), its --max-restarts: it fails"
            job.fail(f"{reason}; {why}")
            raise IncidentError(ErrorType.JOB_GONE, why)
        inc.move(IncidentState.RESTARTING)
        restored_step, path = job.latest_checkpoint()
        for m in (*job.roster.ranks(), *job.roster.departing()):
            job.fence(m)
        await job.changes.wait_for(
            lambda: not job.roster.ranks() and not job.roster.departing(),
            FENCE_TIMEOUT,
            "old ranks to die",
        )
        # Read only now: every frame a rank sent before its connection closed has been handled, so
        # no step it completed is missing from what the restart recomputes.
        failed_at = job.progress.high_water
        job.restart_ranks(path)
        await job.changes.wait_for(
            lambda: len(job.roster.ranks(MemberState.READY)) == job.world_size,
            job.startup_timeout,
            "restarted ranks",
        )
        # A script whose steps the job cannot see (no torch.optim optimizer, `--no-agent`): it
        # trains again once its ranks joined, instead of a step report that never comes (120 s, then
        # a second restart of a healthy job).
        unmeasured = not job.spec.agent and failed_at < 0
        formed = await self._regroup_and_resume(restored_step + 1, unmeasured=unmeasured)
        assert formed is not None  # without an incident, a loss raises
        _, resumed_at = formed
        inc.fallback = FallbackResult(
            restored_step=restored_step,
            failed_at_step=failed_at,
            steps_recomputed=job.progress.recomputed_after(failed_at),
            resumed_at=resumed_at,
            resumed_steps=dict(job.progress.resumed),
            work_seconds=work_seconds(t0),
        )
        inc.move(IncidentState.RESTARTED)
        return inc.fallback

    async def complete(self, ref: IncidentRef, outcome: MigrationOutcome) -> None:
        job = self.job
        if job.incidents.records.file(ref.workflow_id, outcome):
            return  # the job handled it itself (`local.py`): its workflow has now filed it
        if any(o.incident_id == outcome.incident_id for o in job.incidents.outcomes):
            return  # a retried completion: already recorded
        if outcome.disposition is Disposition.NOT_A_FAILURE and not is_current(self.job, ref):
            # a claim confirm refuted: counted apart from the job's incidents, nothing else
            job.end_incident(outcome, refuted=True)
            return
        inc = incident_of(self.job, ref)
        for m in job.roster.departing():  # a recovery that ended before its state moved
            job.fence(m)
        if inc.state is not IncidentState.COMPLETED:
            inc.move(IncidentState.COMPLETED)
            job.spares.refill(inc.workflow_id)  # a new spare for each one that took a slot, at once
        job.end_incident(outcome)
