"""MigrationWorkflow: one durable workflow per incident, from the first report to the recorded outcome.

Started by signal-with-start under an id made of job, failure domain and world generation, so every
report of one failure (the rank's exit, its dropped connection, a node watch) folds into one incident.
Only orchestration lives here: job-side steps run as activities on the job's own task queue, served by
the worker inside the job's coordinator; classification runs on the control queue.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, TypeVar

from temporalio import workflow
from temporalio.common import RetryPolicy, SearchAttributeKey
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from torchpass.classify import primary_kind
    from torchpass.decisions import RecoveryAction, plan_recovery
    from torchpass.ids import (
        CONTROL_TASK_QUEUE,
        SA_JOB_ID,
        SA_KIND,
        SA_OUTCOME,
        SA_QUALIFYING,
        ControlActivity,
        ErrorType,
        JobActivity,
    )
    from torchpass.models import (
        Category,
        Classification,
        ClassifyInput,
        CompleteInput,
        ConfirmInput,
        ConfirmResult,
        Disposition,
        Evidence,
        FailureReport,
        FallbackInput,
        FallbackResult,
        FreezeResult,
        IncidentRef,
        IncidentStatus,
        MigrationOutcome,
        Phase,
        PhaseTiming,
        RejoinResult,
        ReserveResult,
        TransferResult,
    )

R = TypeVar("R")

_JOB_ID = SearchAttributeKey.for_keyword(SA_JOB_ID)
_KIND = SearchAttributeKey.for_keyword(SA_KIND)
_OUTCOME = SearchAttributeKey.for_keyword(SA_OUTCOME)
_QUALIFYING = SearchAttributeKey.for_keyword(SA_QUALIFYING)

_NON_RETRYABLE = [
    ErrorType.NO_SPARE,
    ErrorType.JOB_GONE,
    ErrorType.NO_CHECKPOINT,
    ErrorType.INVALID_INPUT,
    "UnknownIncident",
    "FreezeFailed",
]
_RETRY = RetryPolicy(
    initial_interval=timedelta(milliseconds=200),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=5),
    maximum_attempts=3,
    non_retryable_error_types=_NON_RETRYABLE,
)
# (start_to_close, schedule_to_close): the second bounds a job whose coordinator is gone.
_TIMEOUTS: dict[str, tuple[float, float]] = {
    JobActivity.CONFIRM_FAILURE: (15, 60),
    ControlActivity.CLASSIFY_FAILURE: (10, 60),
    JobActivity.RESERVE_SPARE: (90, 200),  # may wait for a spare still warming up
    JobActivity.RELEASE_SPARE: (15, 60),
    JobActivity.FREEZE_RANKS: (45, 150),
    JobActivity.TRANSFER_STATE: (150, 500),
    JobActivity.REJOIN: (150, 500),
    JobActivity.RESTART_FROM_CHECKPOINT: (300, 900),
    JobActivity.COMPLETE_INCIDENT: (15, 60),
}


class _Failed(Exception):
    """A step of the migration failed past its retries."""


@workflow.defn
class MigrationWorkflow:
    def __init__(self) -> None:
        self._evidence: list[Evidence] = []
        self._job_id = ""
        self._phase = "detect"
        self._disposition: Disposition | None = None
        self._phases: list[PhaseTiming] = []

    @workflow.signal
    def report(self, rep: FailureReport) -> None:
        """Fold another report of this incident; duplicates and other jobs' reports are ignored."""
        ev = rep.evidence
        if self._job_id and ev.job_id != self._job_id:
            workflow.logger.warning(
                "report for job %s ignored by an incident of job %s", ev.job_id, self._job_id
            )
            return
        if ev not in self._evidence:
            self._evidence.append(ev)

    @workflow.query
    def status(self) -> IncidentStatus:
        return IncidentStatus(
            phase=self._phase, evidence_count=len(self._evidence), disposition=self._disposition
        )

    @workflow.run
    async def run(self, first: FailureReport) -> MigrationOutcome:
        self._job_id = first.evidence.job_id
        self.report(first)
        info = workflow.info()
        ref = IncidentRef(incident_id=f"{info.workflow_id}/{info.run_id}", job_id=self._job_id)
        queue = first.job_task_queue
        detected = min(e.observed_at for e in self._evidence)
        started = workflow.now()
        self._phases.append(
            PhaseTiming(phase=Phase.DETECT, seconds=max(0.0, (started - detected).total_seconds()))
        )
        workflow.upsert_search_attributes(
            [
                _JOB_ID.value_set(self._job_id),
                _KIND.value_set(first.evidence.kind.value),
                _OUTCOME.value_set("running"),
            ]
        )

        confirm = await self._call(
            Phase.CONFIRM,
            JobActivity.CONFIRM_FAILURE,
            ConfirmInput(incident=ref, evidence=tuple(self._evidence)),
            ConfirmResult,
            queue,
        )
        classification = await self._call(
            Phase.CLASSIFY,
            ControlActivity.CLASSIFY_FAILURE,
            ClassifyInput(
                evidence=tuple(self._evidence),
                lost_slots=confirm.lost_slots,
                world_size=confirm.world_size,
                redundancy=confirm.redundancy,
            ),
            Classification,
            CONTROL_TASK_QUEUE,
        )
        action = plan_recovery(classification, confirm)
        outcome: dict[str, Any] = {"disposition": Disposition.NOT_A_FAILURE, "success": False}
        if action == RecoveryAction.MIGRATE:
            classification, outcome = await self._migrate(ref, queue, classification)
        elif action == RecoveryAction.FALLBACK:
            outcome = await self._fall_back(ref, queue, classification.reason)
        return await self._record(ref, queue, confirm, classification, detected, outcome)

    async def _migrate(
        self, ref: IncidentRef, queue: str, classification: Classification
    ) -> tuple[Classification, dict[str, Any]]:
        try:
            await self._call(Phase.RESERVE, JobActivity.RESERVE_SPARE, ref, ReserveResult, queue)
        except _Failed as e:
            if _error_type(e) != ErrorType.NO_SPARE:
                return classification, await self._fall_back(ref, queue, str(e.__cause__ or e))
            classification = Classification(
                category=Category.UNABLE_TO_RECOVER,
                qualifying=False,
                reason="Unable to recover: no compatible spare resources were available (disqualifying).",
            )
            return classification, await self._fall_back(ref, queue, "no spare available")
        try:
            await self._call(Phase.FREEZE, JobActivity.FREEZE_RANKS, ref, FreezeResult, queue)
            transfer = await self._call(
                Phase.TRANSFER, JobActivity.TRANSFER_STATE, ref, TransferResult, queue, heartbeat=True
            )
            rejoin = await self._call(Phase.REJOIN, JobActivity.REJOIN, ref, RejoinResult, queue)
        except _Failed as e:
            # Compensation: the spare goes back (or is replaced), then the classic restart.
            await self._try(JobActivity.RELEASE_SPARE, ref, queue)
            return classification, await self._fall_back(ref, queue, str(e.__cause__ or e))
        return classification, {
            "disposition": Disposition.MIGRATED,
            "success": True,
            "proof": transfer.proof,
            "recovered_at": rejoin.resumed_at,
        }

    async def _fall_back(self, ref: IncidentRef, queue: str, reason: str) -> dict[str, Any]:
        try:
            fb = await self._call(
                Phase.FALLBACK,
                JobActivity.RESTART_FROM_CHECKPOINT,
                FallbackInput(incident=ref, reason=reason),
                FallbackResult,
                queue,
            )
        except _Failed as e:
            return {
                "disposition": Disposition.FAILED,
                "success": False,
                "error": f"{reason}; fallback: {e.__cause__ or e}",
            }
        return {
            "disposition": Disposition.FALLBACK_RESTART,
            "success": False,
            "fallback": fb,
            "steps_recomputed": fb.steps_recomputed,
            "recovered_at": fb.resumed_at,
            "error": reason,
        }

    async def _record(
        self,
        ref: IncidentRef,
        queue: str,
        confirm: ConfirmResult,
        classification: Classification,
        detected: datetime,
        outcome: dict[str, Any],
    ) -> MigrationOutcome:
        recovered = outcome.get("recovered_at")
        result = MigrationOutcome(
            incident_id=ref.incident_id,
            job_id=self._job_id,
            failure_domain=self._evidence[0].failure_domain,
            kind=primary_kind(tuple(self._evidence)),
            evidence_count=len(self._evidence),
            classification=classification,
            covered=confirm.covered,
            lost_slots=confirm.lost_slots,
            phases=tuple(self._phases),
            detected_at=detected,
            recovery_seconds=(recovered - detected).total_seconds() if recovered else None,
            **outcome,
        )
        self._disposition = result.disposition
        self._phase = "record"
        if not await self._try(
            JobActivity.COMPLETE_INCIDENT, CompleteInput(incident=ref, outcome=result), queue
        ):
            result = result.model_copy(
                update={"error": (result.error or "") + " (job did not take the record)"}
            )
        workflow.upsert_search_attributes(
            [
                _KIND.value_set(result.kind.value),
                _OUTCOME.value_set(result.disposition.value),
                _QUALIFYING.value_set(str(classification.qualifying).lower()),
            ]
        )
        return result

    async def _call(
        self, phase: Phase, name: str, arg: Any, result_type: type[R], queue: str, heartbeat: bool = False
    ) -> R:
        self._phase = phase.value
        t0 = workflow.now()
        start, total = _TIMEOUTS[name]
        try:
            result = await workflow.execute_activity(
                name,
                arg,
                task_queue=queue,
                result_type=result_type,
                start_to_close_timeout=timedelta(seconds=start),
                schedule_to_close_timeout=timedelta(seconds=total),
                heartbeat_timeout=timedelta(seconds=20) if heartbeat else None,
                retry_policy=_RETRY,
            )
        except ActivityError as e:
            raise _Failed(f"{name} failed") from e.cause
        finally:
            self._phases.append(PhaseTiming(phase=phase, seconds=(workflow.now() - t0).total_seconds()))
        work_seconds = getattr(result, "work_seconds", None)
        if work_seconds is not None:
            self._phases[-1] = self._phases[-1].model_copy(update={"work_seconds": work_seconds})
        return result

    async def _try(self, name: str, arg: Any, queue: str) -> bool:
        """Best-effort steps (compensation, the job's record): failure is noted, never fatal."""
        start, total = _TIMEOUTS[name]
        try:
            await workflow.execute_activity(
                name,
                arg,
                task_queue=queue,
                start_to_close_timeout=timedelta(seconds=start),
                schedule_to_close_timeout=timedelta(seconds=total),
                retry_policy=_RETRY,
            )
        except ActivityError as e:
            workflow.logger.warning("%s failed: %s", name, e.cause)
            return False
        return True


def _error_type(e: BaseException) -> str | None:
    cause = e.__cause__
    return cause.type if isinstance(cause, ApplicationError) else None
