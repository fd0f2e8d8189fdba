"""MigrationWorkflow: one durable workflow per incident, from the first report to the recorded outcome.

Started by signal-with-start under an id made of job, failure domain and world generation
(`torchpass.ids.incident_workflow_id`), so every report of one failure (the rank's exit, its dropped
connection, a node watch, NVML) folds into one incident. Reports that arrive while a step runs are folded
too: nothing waits for more evidence, the next step simply sees all of it.

Only orchestration lives here. Job-side steps are activities on the job's own task queue, served by the worker
inside its coordinator, and referenced by name; classification runs on the control queue, as an activity and
its one owner, so that a change to the table changes future incidents without breaking the replay of old ones.
What the job answers is checked again here (`torchpass.incident.proof`) before a migration is recorded as
live, and the outcome's figures are the job's measurements (`torchpass.incident.outcome`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from temporalio import workflow
from temporalio.common import RawValue, SearchAttributeKey
from temporalio.exceptions import ApplicationError, FailureError

with workflow.unsafe.imports_passed_through():
    from torchpass.errors import ErrorType
    from torchpass.ids import (
        CONTROL_TASK_QUEUE,
        SA_JOB_ID,
        SA_KIND,
        SA_OUTCOME,
        SA_QUALIFYING,
        ContractMessage,
        ControlActivity,
        IncidentMessage,
        JobActivity,
        JobActivityV0,
        WorkflowName,
        contract_workflow_id,
    )
    from torchpass.incident.classify import classify_input, resyncs, unclassified
    from torchpass.incident.decisions import RecoveryAction, plan_recovery
    from torchpass.incident.outcome import (
        CompleteInput,
        Ending,
        IncidentStatus,
        MigrationOutcome,
        bounded_error,
        build_outcome,
    )
    from torchpass.incident.proof import filed_ending, resume_problems, transfer_problems
    from torchpass.incident.steps import (
        ConfirmInput,
        ConfirmResult,
        FallbackInput,
        FallbackResult,
        FreezeResult,
        IncidentRef,
        LocalRecord,
        RejoinResult,
        ReserveResult,
        TransferResult,
    )
    from torchpass.models import (
        Classification,
        Disposition,
        Evidence,
        FailureKind,
        FailureReport,
        Phase,
        PhaseTiming,
    )
    from workflows import legacy
    from workflows.inputs import decode, decode_start
    from workflows.step_calls import StepCalls, StepFailed

_JOB_ID = SearchAttributeKey.for_keyword(SA_JOB_ID)
_KIND = SearchAttributeKey.for_keyword(SA_KIND)
_OUTCOME = SearchAttributeKey.for_keyword(SA_OUTCOME)
_QUALIFYING = SearchAttributeKey.for_keyword(SA_QUALIFYING)
# Histories recorded before this patch replay the legacy path (`workflows.legacy`).
MEASURED = "measured-outcome"
# Incidents the job handled itself while the control plane was away are filed, not run again.
LOCAL = "local-recovery"
# A replica found corrupted is rebuilt from the majority of its shard, live (before: a checkpoint restart).
RESYNC = "resync-from-majority"
# After its outcome, the run stays open for the job's late window (`FailureReport.linger_seconds`).
LATE = "late-evidence"
# Two job activities renamed: `reserve_spares` (was `reserve_spare`), `fetch_local_record` (was
# `recorded_outcome`, which read like the contract's `record_outcome` signal).
NAMES = "activity-names"

# A flapping detector must not grow the history without bound; a real incident has a handful of reports.
MAX_EVIDENCE = 256


@workflow.defn(name=WorkflowName.MIGRATION)
class MigrationWorkflow:
    @workflow.init
    def __init__(self, start: RawValue) -> None:
        # Known before the first signal is handled: signal-with-start delivers its signal with the start.
        self._bad: ApplicationError | None = None
        try:
            first = decode_start(start, FailureReport)
        except ApplicationError as e:  # `run` fails the workflow with it; nothing else happens
            self._bad = e
        self._job_id = "" if self._bad else first.evidence.job_id
        self._steps = StepCalls("" if self._bad else first.job_task_queue)
        self._contract = None if self._bad else first.contract
        self._evidence: list[Evidence] = [] if self._bad else [first.evidence]
        self._disposition: Disposition | None = None
        self._measured = False
        self._renamed = False
        self._late_window = 0.0 if self._bad else first.linger_seconds
        self._outcome: MigrationOutcome | None = None

    @workflow.signal(name=IncidentMessage.REPORT)
    def report(self, raw: RawValue) -> None:
        """Fold another report of this incident; duplicates, other jobs' and malformed reports are ignored
        (a null payload once failed every workflow task of the incident)."""
        if self._bad is not None:
            return
        try:
            rep = decode(raw, FailureReport, "report signal")
        except ApplicationError as e:
            workflow.logger.warning("%s: dropped", e.message)
            return
        ev = rep.evidence
        if (self._outcome is not None and rep.opens) or ev.job_id != self._job_id:
            # Another incident's first report (this one's outcome is recorded), or another job's.
            workflow.logger.warning("report of job %s ignored by this incident's run", ev.job_id)
        elif ev in self._evidence:
            return
        elif len(self._evidence) >= MAX_EVIDENCE:
            workflow.logger.warning("report ignored: incident already holds %d reports", MAX_EVIDENCE)
        else:
            self._evidence.append(ev)

    @workflow.query(name=IncidentMessage.STATUS)
    def status(self) -> IncidentStatus:
        return IncidentStatus(
            phase=self._steps.phase.value,
            evidence_count=len(self._evidence),
            disposition=self._disposition,
            job_id=self._job_id,
            job_task_queue=self._steps.queue,
        )

    @workflow.query(name=IncidentMessage.OUTCOME)
    def outcome(self) -> MigrationOutcome | None:
        """The outcome once recorded (the run may stay open for the late window after it)."""
        return self._outcome

    @workflow.run
    async def run(self, start: RawValue) -> MigrationOutcome:
        if self._bad is not None:
            raise self._bad
        first = self._evidence[0]
        self._measured = workflow.patched(MEASURED)
        self._renamed = workflow.patched(NAMES)
        info = workflow.info()
        ref = IncidentRef(workflow_id=info.workflow_id, run_id=info.run_id, job_id=self._job_id)
        first_kind = first.kind if self._measured else legacy.kind_of(self._evidence)
        workflow.upsert_search_attributes(
            [
                _JOB_ID.value_set(self._job_id),
                _KIND.value_set(first_kind.value),
                _OUTCOME.value_set("running"),
            ]
        )
        confirm, confirm_error, error_type = await self._confirm(ref)
        if error_type == ErrorType.HANDLED_LOCALLY and workflow.patched(LOCAL):
            # The control plane was away when it struck: the job carried the steps out itself.
            return await self._file(ref)
        evidence = tuple(self._evidence)  # what the classification (and so the outcome's kind) is based on
        classification = await self._classify(evidence, confirm)
        if confirm is None:
            # The job did not answer: live migration needs it, a restart may still work.
            ending = await self._fall_back(ref, confirm_error or "confirm failed")
        else:
            resync = resyncs(classification) and workflow.patched(RESYNC)
            action = plan_recovery(classification, confirm, resync)
            if action is RecoveryAction.MIGRATE:
                classification, ending = await self._migrate(ref, evidence, confirm, classification)
            elif action is RecoveryAction.FALLBACK:
                ending = await self._fall_back(ref, classification.reason)
            else:
                ending = Ending(disposition=Disposition.NOT_A_FAILURE)
        outcome = build_outcome(
            ref.incident_id,
            self._evidence,
            self._kind(evidence, classification),
            classification,
            confirm,
            ending,
            workflow.info().workflow_start_time,
            tuple(self._steps.phases.values()),
        )
        return await self._complete(ref, outcome)

    def _kind(self, evidence: tuple[Evidence, ...], c: Classification) -> FailureKind:
        """The kind that named the category, as the classifier said (our clock never reads the table)."""
        if not self._measured:
            return legacy.kind_of(evidence)
        return c.kind or evidence[0].kind

    async def _confirm(self, ref: IncidentRef) -> tuple[ConfirmResult | None, str | None, str | None]:
        inp = ConfirmInput(incident=ref, evidence=tuple(self._evidence))
        try:
            confirm = await self._steps.call(Phase.CONFIRM, JobActivity.CONFIRM_FAILURE, inp, ConfirmResult)
        except StepFailed as e:
            return None, str(e), e.error_type
        return confirm, None, None

    async def _file(self, ref: IncidentRef) -> MigrationOutcome:
        """File what the job did itself: its record, classified here and its proof checked here, then
        recorded once like any outcome. No record to be had is a failure on the record, with why."""
        why = ""
        try:
            name = JobActivity.FETCH_LOCAL_RECORD if self._renamed else JobActivityV0.RECORDED_OUTCOME
            raw = await self._steps.call(Phase.RECORD, name, ref, RawValue)
            rec: LocalRecord | None = decode(raw, LocalRecord, f"{name} result")
            if rec is not None and rec.workflow_id != workflow.info().workflow_id:
                raise ApplicationError(f"a record of {rec.workflow_id}, not of this incident")
        except (StepFailed, ApplicationError) as e:
            rec, why = None, f"the job handled this incident itself, but gave no record of it: {e}"
        mine = tuple(ev for ev in rec.evidence if ev.job_id == self._job_id) if rec else ()
        evidence = mine or tuple(self._evidence)
        confirm = rec.confirm if rec else None
        classification = await self._classify(evidence, confirm)
        ending = filed_ending(rec) if rec else Ending(Disposition.FAILED, error=why)
        classified = self._steps.phases.get(Phase.CLASSIFY)
        phases = (*(rec.phases if rec else ()), *([classified] if classified else []))
        started = rec.started_at if rec else workflow.info().workflow_start_time
        kind = self._kind(evidence, classification)
        outcome = build_outcome(
            ref.incident_id, evidence, kind, classification, confirm, ending, started, phases
        )
        return await self._complete(ref, outcome.model_copy(update={"handled_locally": True}))

    async def _classify(
        self, evidence: tuple[Evidence, ...], confirm: ConfirmResult | None, spare_lost: bool = False
    ) -> Classification:
        if self._measured:
            # Spare availability is evidence too: measured when the job confirmed, or learnt when the
            # reservation found none.
            inp = classify_input(evidence, confirm, spare_lost)
        else:
            inp = legacy.classify_input(evidence, confirm)
        try:
            c = await self._steps.call(
                Phase.CLASSIFY, ControlActivity.CLASSIFY_FAILURE, inp, Classification, CONTROL_TASK_QUEUE
            )
        except StepFailed as e:
            # Our own step failed: it must never disqualify the customer's failure.
            c = unclassified(str(e)) if self._measured else legacy.judged_by_kind(evidence, str(e))
        workflow.upsert_search_attributes(
            [
                _KIND.value_set(self._kind(evidence, c).value),
                _QUALIFYING.value_set("true" if c.qualifying else "false"),
            ]
        )
        return c

    async def _migrate(
        self,
        ref: IncidentRef,
        evidence: tuple[Evidence, ...],
        confirm: ConfirmResult,
        classification: Classification,
    ) -> tuple[Classification, Ending]:
        try:
            reserve = JobActivity.RESERVE_SPARES if self._renamed else JobActivityV0.RESERVE_SPARE
            await self._steps.call(Phase.RESERVE, reserve, ref, ReserveResult)
        except StepFailed as e:
            if e.error_type != ErrorType.NO_SPARE:
                # The reservation may have half-happened: give back whatever was taken.
                await self._steps.attempt(JobActivity.RELEASE_SPARE, ref)
                return classification, await self._fall_back(ref, str(e))
            if self._measured:
                classification = await self._classify(evidence, confirm, spare_lost=True)
            else:
                classification = legacy.no_spare()
                workflow.upsert_search_attributes([_QUALIFYING.value_set("false")])
            return classification, await self._fall_back(ref, classification.reason)
        try:
            frozen = await self._steps.call(Phase.FREEZE, JobActivity.FREEZE_RANKS, ref, FreezeResult)
            transfer = await self._steps.call(Phase.TRANSFER, JobActivity.TRANSFER_STATE, ref, TransferResult)
            self._check(JobActivity.TRANSFER_STATE, transfer_problems(transfer.proof, frozen.target_step))
            rejoin = await self._steps.call(Phase.REJOIN, JobActivity.REJOIN, ref, RejoinResult)
            # A rank lost after the state moved was supplied before the group re-formed: a new proof.
            proof = rejoin.proof or transfer.proof
            self._check(JobActivity.REJOIN, transfer_problems(proof, frozen.target_step))
            self._check(JobActivity.REJOIN, resume_problems(rejoin.resumed_steps, rejoin.resumed_step))
        except StepFailed as e:
            # Compensation: the spare goes back to the pool, then the classic restart.
            await self._steps.attempt(JobActivity.RELEASE_SPARE, ref)
            return classification, await self._fall_back(ref, str(e))
        return classification, Ending(Disposition.MIGRATED, proof=proof, rejoin=rejoin)

    def _check(self, name: str, problems: list[str]) -> None:
        """The job's answer must hold on its own figures before the migration counts as live."""
        if self._measured and problems:
            raise StepFailed(name, why="proof does not hold: " + "; ".join(problems))

    async def _fall_back(self, ref: IncidentRef, reason: str) -> Ending:
        inp = FallbackInput(incident=ref, reason=reason)
        try:
            fb = await self._steps.call(
                Phase.FALLBACK, JobActivity.RESTART_FROM_CHECKPOINT, inp, FallbackResult
            )
        except StepFailed as e:
            return Ending(Disposition.FAILED, error=f"{reason}; fallback: {e}")
        return Ending(Disposition.FALLBACK_RESTART, fallback=fb, error=reason)

    async def _complete(self, ref: IncidentRef, outcome: MigrationOutcome) -> MigrationOutcome:
        """The contract and the job record the outcome; it stands, with the error, if either cannot."""
        self._disposition = outcome.disposition
        self._steps.phase = Phase.RECORD
        t0 = workflow.now()
        errors = [e for e in (outcome.error, await self._record_on_contract(outcome)) if e]
        if errors != [e for e in (outcome.error,) if e]:
            outcome = outcome.model_copy(update={"error": bounded_error("; ".join(errors))})
        stored = await self._steps.attempt(
            JobActivity.COMPLETE_INCIDENT, CompleteInput(incident=ref, outcome=outcome)
        )
        record = PhaseTiming(phase=Phase.RECORD, seconds=(workflow.now() - t0).total_seconds())
        update: dict[str, Any] = {"phases": (*outcome.phases, record)}
        if stored is not None:
            update["error"] = bounded_error(f"{outcome.error}; {stored}" if outcome.error else stored)
        workflow.upsert_search_attributes([_OUTCOME.value_set(outcome.disposition.value)])
        self._outcome = outcome.model_copy(update=update)
        if self._late_window > 0 and workflow.patched(LATE):
            # Open a while: evidence that comes after the outcome (a NotReady 40 s after the node died) is
            # signalled here by the job, into this history; the outcome stands (`outcome` answers it).
            await asyncio.sleep(self._late_window)
        return self._outcome

    async def _record_on_contract(self, outcome: MigrationOutcome) -> str | None:
        """Signal the job's contract workflow; a contract that is not running is an error kept here."""
        c = self._contract
        if c is None:
            return None
        contract = workflow.get_external_workflow_handle(contract_workflow_id(c.customer_id, c.contract_id))
        try:
            await contract.signal(ContractMessage.RECORD_OUTCOME, outcome)
        except FailureError as e:
            workflow.logger.warning("contract %s did not take the outcome: %s", c.contract_id, e)
            return f"not recorded on contract {c.contract_id} of {c.customer_id}: {e}"
        return None
