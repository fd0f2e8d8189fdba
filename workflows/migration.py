"""MigrationWorkflow: one durable workflow per incident, from the first report to the recorded outcome.

Started by signal-with-start under an id made of job, failure domain and world generation
(`torchpass.ids.incident_workflow_id`), so every report of one failure (the rank's exit, its dropped
connection, a node watch, NVML) folds into one incident. Reports that arrive while a step runs are folded
too: nothing waits for more evidence, the next step simply sees all of it.

Only orchestration lives here. Job-side steps are activities on the job's own task queue, served by the
worker inside its coordinator, and referenced by name; classification runs on the control queue, as an
activity, so that a change to the table changes future incidents without breaking the replay of old ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

from temporalio import workflow
from temporalio.common import SearchAttributeKey
from temporalio.exceptions import ActivityError, ApplicationError, FailureError

with workflow.unsafe.imports_passed_through():
    from torchpass.classify import (
        CATEGORY_OF,
        NO_SPARE_REASON,
        ROW_TITLE,
        primary_kind,
        unable_to_recover,
    )
    from torchpass.decisions import RecoveryAction, plan_recovery
    from torchpass.errors import ErrorType
    from torchpass.ids import (
        CONTROL_TASK_QUEUE,
        SA_JOB_ID,
        SA_KIND,
        SA_OUTCOME,
        SA_QUALIFYING,
        ControlActivity,
        JobActivity,
        contract_workflow_id,
    )
    from torchpass.models import (
        QUALIFYING_CATEGORIES,
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
        TransferProof,
        TransferResult,
    )
    from torchpass.policies import ACTIVITY_TIMEOUTS, MIGRATION_RETRY
    from workflows.policy import retry_policy

R = TypeVar("R")

_JOB_ID = SearchAttributeKey.for_keyword(SA_JOB_ID)
_KIND = SearchAttributeKey.for_keyword(SA_KIND)
_OUTCOME = SearchAttributeKey.for_keyword(SA_OUTCOME)
_QUALIFYING = SearchAttributeKey.for_keyword(SA_QUALIFYING)
RETRY_POLICY = retry_policy(MIGRATION_RETRY)

# A flapping detector must not grow the history without bound; a real incident has a handful of reports.
MAX_EVIDENCE = 256


class _Failed(Exception):
    """A step failed past its retries (or with a non-retryable error)."""

    def __init__(self, name: str, err: ActivityError) -> None:
        cause = err.cause
        self.error_type = cause.type if isinstance(cause, ApplicationError) else None
        super().__init__(f"{name} failed: {cause or err}")


@dataclass
class _Result:
    """How the incident ended, before it becomes a MigrationOutcome."""

    disposition: Disposition
    success: bool = False
    proof: TransferProof | None = None
    fallback: FallbackResult | None = None
    recovered_at: datetime | None = None
    steps_recomputed: int = 0
    error: str | None = None


@workflow.defn(name="MigrationWorkflow")
class MigrationWorkflow:
    @workflow.init
    def __init__(self, first: FailureReport) -> None:
        # Known before the first signal is handled: signal-with-start delivers its signal with the start.
        self._job_id = first.evidence.job_id
        self._queue = first.job_task_queue
        self._contract = first.contract
        self._evidence: list[Evidence] = [first.evidence]
        self._phase = Phase.DETECT
        self._disposition: Disposition | None = None
        self._phases: list[PhaseTiming] = []

    @workflow.signal
    def report(self, rep: FailureReport) -> None:
        """Fold another report of this incident; duplicates and other jobs' reports are ignored."""
        ev = rep.evidence
        if ev.job_id != self._job_id:
            workflow.logger.warning(
                "report for job %s ignored by an incident of job %s", ev.job_id, self._job_id
            )
        elif ev in self._evidence:
            return
        elif len(self._evidence) >= MAX_EVIDENCE:
            workflow.logger.warning("report ignored: incident already holds %d reports", MAX_EVIDENCE)
        else:
            self._evidence.append(ev)

    @workflow.query
    def status(self) -> IncidentStatus:
        return IncidentStatus(
            phase=self._phase.value, evidence_count=len(self._evidence), disposition=self._disposition
        )

    @workflow.run
    async def run(self, first: FailureReport) -> MigrationOutcome:
        info = workflow.info()
        ref = IncidentRef(incident_id=f"{info.workflow_id}/{info.run_id}", job_id=self._job_id)
        workflow.upsert_search_attributes(
            [
                _JOB_ID.value_set(self._job_id),
                _KIND.value_set(primary_kind(self._evidence).value),
                _OUTCOME.value_set("running"),
            ]
        )
        confirm, confirm_error = await self._confirm(ref)
        evidence = tuple(self._evidence)  # what the classification (and so the outcome's kind) is based on
        classification = await self._classify(evidence, confirm)
        if confirm is None:
            # The job did not answer: live migration needs it, a restart may still work.
            result = await self._fall_back(ref, confirm_error or "confirm failed")
        else:
            action = plan_recovery(classification, confirm)
            if action is RecoveryAction.MIGRATE:
                classification, result = await self._migrate(ref, classification)
            elif action is RecoveryAction.FALLBACK:
                result = await self._fall_back(ref, classification.reason)
            else:
                result = _Result(disposition=Disposition.NOT_A_FAILURE)
        outcome = self._outcome(ref, evidence, classification, confirm, result)
        return await self._complete(ref, outcome)

    async def _confirm(self, ref: IncidentRef) -> tuple[ConfirmResult | None, str | None]:
        inp = ConfirmInput(incident=ref, evidence=tuple(self._evidence))
        try:
            return await self._call(Phase.CONFIRM, JobActivity.CONFIRM_FAILURE, inp, ConfirmResult), None
        except _Failed as e:
            return None, str(e)

    async def _classify(
        self, evidence: tuple[Evidence, ...], confirm: ConfirmResult | None
    ) -> Classification:
        inp = ClassifyInput(
            evidence=evidence,
            lost_slots=confirm.lost_slots if confirm else (),
            world_size=confirm.world_size if confirm else 0,
            redundancy=confirm.redundancy if confirm else 0,
        )
        try:
            c = await self._call(
                Phase.CLASSIFY, ControlActivity.CLASSIFY_FAILURE, inp, Classification, CONTROL_TASK_QUEUE
            )
        except _Failed as e:
            # Our own step failed: never let that disqualify the customer's failure, judge by its kind.
            category = CATEGORY_OF[primary_kind(evidence)]
            c = Classification(
                category=category,
                qualifying=category in QUALIFYING_CATEGORIES,
                reason=f"{ROW_TITLE[category]}, judged by the failure's kind alone ({e})",
            )
        self._set_classification(evidence, c)
        return c

    async def _migrate(
        self, ref: IncidentRef, classification: Classification
    ) -> tuple[Classification, _Result]:
        try:
            await self._call(Phase.RESERVE, JobActivity.RESERVE_SPARE, ref, ReserveResult)
        except _Failed as e:
            if e.error_type != ErrorType.NO_SPARE:
                # The reservation may have half-happened: give back whatever was taken.
                await self._try(JobActivity.RELEASE_SPARE, ref)
                return classification, await self._fall_back(ref, str(e))
            classification = unable_to_recover(NO_SPARE_REASON)
            workflow.upsert_search_attributes([_QUALIFYING.value_set("false")])
            return classification, await self._fall_back(ref, classification.reason)
        try:
            await self._call(Phase.FREEZE, JobActivity.FREEZE_RANKS, ref, FreezeResult)
            transfer = await self._call(Phase.TRANSFER, JobActivity.TRANSFER_STATE, ref, TransferResult)
            rejoin = await self._call(Phase.REJOIN, JobActivity.REJOIN, ref, RejoinResult)
        except _Failed as e:
            # Compensation: the spare goes back to the pool, then the classic restart.
            await self._try(JobActivity.RELEASE_SPARE, ref)
            return classification, await self._fall_back(ref, str(e))
        result = _Result(
            Disposition.MIGRATED, success=True, proof=transfer.proof, recovered_at=rejoin.resumed_at
        )
        return classification, result

    async def _fall_back(self, ref: IncidentRef, reason: str) -> _Result:
        inp = FallbackInput(incident=ref, reason=reason)
        try:
            fb = await self._call(Phase.FALLBACK, JobActivity.RESTART_FROM_CHECKPOINT, inp, FallbackResult)
        except _Failed as e:
            return _Result(Disposition.FAILED, error=f"{reason}; fallback: {e}")
        return _Result(
            Disposition.FALLBACK_RESTART,
            fallback=fb,
            recovered_at=fb.resumed_at,
            steps_recomputed=fb.steps_recomputed,
            error=reason,
        )

    def _outcome(
        self,
        ref: IncidentRef,
        evidence: tuple[Evidence, ...],
        classification: Classification,
        confirm: ConfirmResult | None,
        r: _Result,
    ) -> MigrationOutcome:
        detected = min(e.observed_at for e in self._evidence)
        started = workflow.info().workflow_start_time
        detect = PhaseTiming(phase=Phase.DETECT, seconds=max(0.0, (started - detected).total_seconds()))
        recovered = r.recovered_at
        return MigrationOutcome(
            incident_id=ref.incident_id,
            job_id=self._job_id,
            failure_domain=self._evidence[0].failure_domain,
            kind=primary_kind(evidence),
            evidence_count=len(self._evidence),
            classification=classification,
            covered=confirm.covered if confirm else False,
            disposition=r.disposition,
            success=r.success,
            lost_slots=confirm.lost_slots if confirm else (),
            steps_recomputed=r.steps_recomputed,
            phases=(detect, *self._phases),
            proof=r.proof,
            fallback=r.fallback,
            error=r.error,
            detected_at=detected,
            recovered_at=recovered,
            recovery_seconds=max(0.0, (recovered - detected).total_seconds()) if recovered else None,
        )

    async def _complete(self, ref: IncidentRef, outcome: MigrationOutcome) -> MigrationOutcome:
        """The contract and the job record the outcome; it stands, with the error, if either cannot."""
        self._disposition = outcome.disposition
        self._phase = Phase.RECORD
        t0 = workflow.now()
        errors = [e for e in (outcome.error, await self._record_on_contract(outcome)) if e]
        if errors != [e for e in (outcome.error,) if e]:
            outcome = outcome.model_copy(update={"error": "; ".join(errors)})
        stored = await self._try(JobActivity.COMPLETE_INCIDENT, CompleteInput(incident=ref, outcome=outcome))
        record = PhaseTiming(phase=Phase.RECORD, seconds=(workflow.now() - t0).total_seconds())
        update: dict[str, Any] = {"phases": (*outcome.phases, record)}
        if stored is not None:
            update["error"] = f"{outcome.error}; {stored}" if outcome.error else stored
        workflow.upsert_search_attributes([_OUTCOME.value_set(outcome.disposition.value)])
        return outcome.model_copy(update=update)

    async def _record_on_contract(self, outcome: MigrationOutcome) -> str | None:
        """Signal the job's contract workflow; a contract that is not running is an error kept here."""
        c = self._contract
        if c is None:
            return None
        contract = workflow.get_external_workflow_handle(contract_workflow_id(c.customer_id, c.contract_id))
        try:
            await contract.signal("record_outcome", outcome)
        except FailureError as e:
            workflow.logger.warning("contract %s did not take the outcome: %s", c.contract_id, e)
            return f"not recorded on contract {c.contract_id} of {c.customer_id}: {e}"
        return None

    def _set_classification(self, evidence: tuple[Evidence, ...], c: Classification) -> None:
        workflow.upsert_search_attributes(
            [
                _KIND.value_set(primary_kind(evidence).value),
                _QUALIFYING.value_set("true" if c.qualifying else "false"),
            ]
        )

    async def _call(
        self, phase: Phase, name: str, arg: Any, result_type: type[R], queue: str | None = None
    ) -> R:
        """One step: the activity by name, its timeouts and retries, and its timing."""
        self._phase = phase
        t = ACTIVITY_TIMEOUTS[name]
        t0 = workflow.now()
        work: float | None = None
        try:
            result = await workflow.execute_activity(
                name,
                arg,
                task_queue=queue or self._queue,
                result_type=result_type,
                start_to_close_timeout=t.start_to_close,
                schedule_to_close_timeout=t.schedule_to_close,
                heartbeat_timeout=t.heartbeat,
                retry_policy=RETRY_POLICY,
            )
            work = getattr(result, "work_seconds", None)
            return result
        except ActivityError as e:
            raise _Failed(name, e) from e
        finally:
            seconds = (workflow.now() - t0).total_seconds()
            self._phases.append(PhaseTiming(phase=phase, seconds=seconds, work_seconds=work))

    async def _try(self, name: str, arg: Any) -> str | None:
        """A best-effort job step (compensation, the job's record): returns the error instead of raising."""
        t = ACTIVITY_TIMEOUTS[name]
        try:
            await workflow.execute_activity(
                name,
                arg,
                task_queue=self._queue,
                start_to_close_timeout=t.start_to_close,
                schedule_to_close_timeout=t.schedule_to_close,
                retry_policy=RETRY_POLICY,
            )
        except ActivityError as e:
            workflow.logger.warning("%s failed: %s", name, e.cause or e)
            return str(_Failed(name, e))
        return None
