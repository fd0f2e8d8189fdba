"""The job's own recovery, for when the control plane is away: the job never waits on Temporal.

An incident that no workflow step reached within `incident.LOCAL_AFTER` (the server down, every
control worker gone) is carried out here with the very steps the workflow would have asked for
(`steps.IncidentSteps`), in its order: confirm, classify (the same pure table), reserve, freeze,
transfer, rejoin, each answer checked by the same proof, and the classic restart when the migration
cannot go on. Retryable step errors are tried again as often as the workflow's retry policy would.

What it did is kept as a `LocalRecord` (in memory and in the job's state directory) and,
provisionally, as an outcome in the job's own list. The incident's workflow files it once Temporal
takes the reports again: the job refuses it the steps (`HandledLocally`), it fetches the record
(`fetch_local_record`), classifies it on the control worker, checks its proof and records it on the
contract, once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import TypeVar

from job_agent.coordinator.incident.executor import IncidentSteps
from job_agent.coordinator.incident.lifecycle import Incident, IncidentError
from job_agent.coordinator.waiting import JobFailed
from torchpass.errors import ErrorType
from torchpass.ids import JobActivity
from torchpass.incident.classify import classify, classify_input
from torchpass.incident.decisions import RecoveryAction, plan_recovery
from torchpass.incident.outcome import Ending, MigrationOutcome, bounded_error, build_outcome
from torchpass.incident.proof import resume_problems, transfer_problems
from torchpass.incident.steps import (
    MAX_RECORD_EVIDENCE,
    ConfirmResult,
    FreezeResult,
    IncidentRef,
    LocalRecord,
)
from torchpass.models import Classification, Disposition, Phase, PhaseTiming
from torchpass.policies import MIGRATION_RETRY

log = logging.getLogger("torchpass.coordinator")
R = TypeVar("R")


class _StepFailed(Exception):
    def __init__(
        self, name: str, error: BaseException | str, error_type: ErrorType | None = None
    ) -> None:
        self.error_type = error_type
        super().__init__(f"{name} failed: {error}")


class LocalRecovery:
    """Registered with the job's incidents: runs the incidents no workflow step reached."""

    def __init__(self, steps: IncidentSteps) -> None:
        self.steps = steps
        self.job = steps.job
        self.job.incidents.on_unanswered = self.run

    async def run(self, inc: Incident) -> None:
        run = _Run(self.steps, inc)
        record, outcome = await run.recover()
        log.warning(
            "incident %s handled by the job itself: %s", inc.workflow_id, record.disposition.value
        )
        await self.steps.complete(IncidentRef.local(inc.workflow_id, self.job.job_id), outcome)
        self.job.incidents.records.keep(inc, record)


class _Run:
    def __init__(self, steps: IncidentSteps, inc: Incident) -> None:
        self.steps, self.inc, self.wid = steps, inc, inc.workflow_id
        self.ref = IncidentRef.local(inc.workflow_id, steps.job.job_id)
        self.phases: dict[Phase, PhaseTiming] = {}
        self.started = datetime.now(UTC)
        self.confirm: ConfirmResult | None = None
        self.frozen: FreezeResult | None = None

    async def recover(self) -> tuple[LocalRecord, MigrationOutcome]:
        steps, wid, ref = self.steps, self.wid, self.ref
        evidence = tuple(self.inc.evidence)[:MAX_RECORD_EVIDENCE]
        try:
            call = lambda: steps.confirm(ref, evidence)  # noqa: E731
            self.confirm = await self._step(Phase.CONFIRM, JobActivity.CONFIRM_FAILURE, call)
        except _StepFailed as e:
            classification = classify(classify_input(evidence, None))
            ending = await self._fall_back(str(e))
        else:
            classification = classify(classify_input(evidence, self.confirm))
            action = plan_recovery(classification, self.confirm)
            if action is RecoveryAction.MIGRATE:
                classification, ending = await self._migrate(classification)
            elif action is RecoveryAction.FALLBACK:
                ending = await self._fall_back(classification.reason)
            else:
                ending = Ending(disposition=Disposition.NOT_A_FAILURE)
        evidence = tuple(self.inc.evidence)[:MAX_RECORD_EVIDENCE]  # and what arrived while it ran
        phases = tuple(self.phases.values())
        record = LocalRecord(
            workflow_id=wid,
            evidence=evidence,
            started_at=self.started,
            confirm=self.confirm,
            frozen=self.frozen,
            disposition=ending.disposition,
            proof=ending.proof,
            rejoin=ending.rejoin,
            fallback=ending.fallback,
            error=bounded_error(ending.error),
            phases=phases,
        )
        kind = classification.kind or evidence[0].kind
        outcome = build_outcome(
            ref.incident_id,
            evidence,
            kind,
            classification,
            self.confirm,
            ending,
            self.started,
            phases,
        ).model_copy(update={"handled_locally": True})
        return record, outcome

    async def _migrate(self, classification: Classification) -> tuple[Classification, Ending]:
        steps, ref, confirm = self.steps, self.ref, self.confirm
        assert confirm is not None
        try:
            await self._step(Phase.RESERVE, JobActivity.RESERVE_SPARES, lambda: steps.reserve(ref))
        except _StepFailed as e:
            if e.error_type is not ErrorType.NO_SPARE:
                await self._release()
                return classification, await self._fall_back(str(e))
            classification = classify(
                classify_input(tuple(self.inc.evidence), confirm, spare_lost=True)
            )
            return classification, await self._fall_back(classification.reason)
        try:
            freeze = lambda: steps.freeze(ref)  # noqa: E731
            self.frozen = frozen = await self._step(Phase.FREEZE, JobActivity.FREEZE_RANKS, freeze)
            move = lambda: steps.transfer(ref, lambda n: None)  # noqa: E731
            transfer = await self._step(Phase.TRANSFER, JobActivity.TRANSFER_STATE, move)
            _check(
                JobActivity.TRANSFER_STATE, transfer_problems(transfer.proof, frozen.target_step)
            )
            rejoin = await self._step(Phase.REJOIN, JobActivity.REJOIN, lambda: steps.rejoin(ref))
            proof = rejoin.proof or transfer.proof
            _check(JobActivity.REJOIN, transfer_problems(proof, frozen.target_step))
            _check(JobActivity.REJOIN, resume_problems(rejoin.resumed_steps, rejoin.resumed_step))
        except _StepFailed as e:
            await self._release()
            return classification, await self._fall_back(str(e))
        return classification, Ending(Disposition.MIGRATED, proof=proof, rejoin=rejoin)

    async def _release(self) -> None:
        try:
            await self.steps.release(self.ref)
        except IncidentError as e:
            log.warning("%s failed: %s", JobActivity.RELEASE_SPARE, e)

    async def _fall_back(self, reason: str) -> Ending:
        call = lambda: self.steps.restart_from_checkpoint(self.ref, reason)  # noqa: E731
        try:
            fb = await self._step(Phase.FALLBACK, JobActivity.RESTART_FROM_CHECKPOINT, call)
        except _StepFailed as e:
            return Ending(Disposition.FAILED, error=f"{reason}; fallback: {e}")
        return Ending(Disposition.FALLBACK_RESTART, fallback=fb, error=reason)

    async def _step(self, phase: Phase, name: str, call: Callable[[], Awaitable[R]]) -> R:
        """One step, tried again on a retryable error as the workflow's retry policy would, and
        timed."""
        t0 = time.perf_counter()
        work: float | None = None
        delay = MIGRATION_RETRY.initial.total_seconds()
        try:
            for attempt in range(1, MIGRATION_RETRY.attempts + 1):
                try:
                    result = await call()
                    work = getattr(result, "work_seconds", None)
                    return result
                except IncidentError as e:
                    if not e.retryable or attempt == MIGRATION_RETRY.attempts:
                        raise _StepFailed(name, e, e.error_type) from e
                except TimeoutError as e:
                    if attempt == MIGRATION_RETRY.attempts:
                        raise _StepFailed(name, e, ErrorType.TIMEOUT) from e
                except JobFailed as e:  # the job is ending: nothing to retry
                    raise _StepFailed(name, e, ErrorType.JOB_GONE) from e
                # a step's own defect still ends in a record, never a stuck job
                except Exception as e:
                    raise _StepFailed(name, f"{type(e).__name__}: {e}") from e
                await asyncio.sleep(delay)
                delay = min(
                    delay * MIGRATION_RETRY.backoff, MIGRATION_RETRY.maximum.total_seconds()
                )
            raise AssertionError("unreachable")
        finally:
            prior = self.phases.get(phase)
            seconds = time.perf_counter() - t0 + (prior.seconds if prior else 0.0)
            self.phases[phase] = PhaseTiming(phase=phase, seconds=seconds, work_seconds=work)


def _check(name: str, problems: list[str]) -> None:
    if problems:
        raise _StepFailed(name, "proof does not hold: " + "; ".join(problems))
