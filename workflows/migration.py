"""MigrationWorkflow: one durable workflow per incident, from the first report to the recorded
outcome.

Started by signal-with-start under an id made of job, failure domain and world generation
(`torchpass.ids.incident_workflow_id`), so every report of one failure (the rank's exit, its dropped
connection, a node watch, NVML) folds into one incident. Reports that arrive while a step runs are
folded too: nothing waits for more evidence, the next step simply sees all of it.

Only orchestration lives here: which path an incident takes, and every `workflow.patched` that
decides one. The steps live beside it: confirming, classifying, migrating live or falling back in
`workflows.recovery`; filing an incident the job handled itself and recording every outcome in
`workflows.recording`; each activity call, with its timeouts and retries, timed into the incident's
phases, in `workflows.step_calls`.
"""

from __future__ import annotations

import asyncio

from temporalio import workflow
from temporalio.common import RawValue
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from torchpass.errors import ErrorType
    from torchpass.ids import IncidentMessage, WorkflowName
    from torchpass.incident.classify import resyncs
    from torchpass.incident.decisions import RecoveryAction, plan_recovery
    from torchpass.incident.outcome import Ending, IncidentStatus, MigrationOutcome, build_outcome
    from torchpass.incident.steps import IncidentRef
    from torchpass.models import Disposition, Evidence, FailureReport
    from workflows import legacy
    from workflows.inputs import decode, decode_start
    from workflows.logs import logger
    from workflows.recording import file_local_record, record_outcome
    from workflows.recovery import Recovery
    from workflows.search_attributes import JOB_ID, KIND, OUTCOME
    from workflows.step_calls import StepCalls

# Histories recorded before this patch replay the legacy path (`workflows.legacy`).
MEASURED = "measured-outcome"
# Incidents the job handled itself while the control plane was away are filed, not run again.
LOCAL = "local-recovery"
# A replica found corrupted is rebuilt from the majority of its shard, live (before: a checkpoint
# restart).
RESYNC = "resync-from-majority"
# After its outcome, the run stays open for the job's late window (`FailureReport.linger_seconds`).
LATE = "late-evidence"
# A recovery whose state lost its only source (a drained plain-FSDP rank dying before its shard
# moved) is classified beyond redundancy, not as the planned move it began as.
BY_WHAT_HAPPENED = "classified-by-what-happened"
# The job signs each outcome's facts before the contract records it (`workflows.recording`).
ATTESTED = "job-attestation"
# Two job activities renamed: `reserve_spares` (was `reserve_spare`), `fetch_local_record` (was
# `recorded_outcome`, which read like the contract's `record_outcome` signal).
NAMES = "activity-names"

# A flapping detector must not grow the history without bound; a real incident has a handful of
# reports.
MAX_EVIDENCE = 256


@workflow.defn(name=WorkflowName.MIGRATION)
class MigrationWorkflow:
    @workflow.init
    def __init__(self, start: RawValue) -> None:
        # Known before the first signal is handled: signal-with-start delivers its signal with the
        # start.
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
        self._late_window = 0.0 if self._bad else first.linger_seconds
        self._outcome: MigrationOutcome | None = None

    @workflow.signal(name=IncidentMessage.REPORT)
    def report(self, raw: RawValue) -> None:
        """Fold another report of this incident; duplicates, other jobs' and malformed reports are
        ignored (a null payload once failed every workflow task of the incident)."""
        if self._bad is not None:
            return
        try:
            rep = decode(raw, FailureReport, "report signal")
        except ApplicationError as e:
            logger.warning("%s: dropped", e.message)
            return
        ev = rep.evidence
        if (self._outcome is not None and rep.opens) or ev.job_id != self._job_id:
            # Another incident's first report (this one's outcome is recorded), or another job's.
            logger.warning("report of job %s ignored by this incident's run", ev.job_id)
        elif ev in self._evidence:
            return
        elif len(self._evidence) >= MAX_EVIDENCE:
            logger.warning("report ignored: incident already holds %d reports", MAX_EVIDENCE)
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
        measured = workflow.patched(MEASURED)
        renamed = workflow.patched(NAMES)
        recovery = Recovery(self._steps, measured, renamed, workflow.patched(BY_WHAT_HAPPENED))
        info = workflow.info()
        ref = IncidentRef(workflow_id=info.workflow_id, run_id=info.run_id, job_id=self._job_id)
        first_kind = first.kind if measured else legacy.kind_of(self._evidence)
        workflow.upsert_search_attributes(
            [
                JOB_ID.value_set(self._job_id),
                KIND.value_set(first_kind.value),
                OUTCOME.value_set("running"),
            ]
        )
        confirm, confirm_error, error_type = await recovery.confirm(ref, tuple(self._evidence))
        if error_type == ErrorType.HANDLED_LOCALLY and workflow.patched(LOCAL):
            # The control plane was away when it struck: the job carried the steps out itself.
            return await self._complete(ref, await file_local_record(recovery, ref, self._evidence))
        # what the classification (and so the outcome's kind) is based on
        evidence = tuple(self._evidence)
        classification = await recovery.classify(evidence, confirm)
        if confirm is None:
            # The job did not answer: live migration needs it, a restart may still work.
            ending = await recovery.fall_back(ref, confirm_error or "confirm failed")
        else:
            resync = resyncs(classification) and workflow.patched(RESYNC)
            action = plan_recovery(classification, confirm, resync)
            if action is RecoveryAction.MIGRATE:
                classification, ending = await recovery.migrate(
                    ref, evidence, confirm, classification
                )
            elif action is RecoveryAction.FALLBACK:
                ending = await recovery.fall_back(ref, classification.reason)
            else:
                ending = Ending(disposition=Disposition.NOT_A_FAILURE)
        outcome = build_outcome(
            ref.incident_id,
            self._evidence,
            recovery.kind(evidence, classification),
            classification,
            confirm,
            ending,
            workflow.info().workflow_start_time,
            tuple(self._steps.phases.values()),
        )
        return await self._complete(ref, outcome)

    async def _complete(self, ref: IncidentRef, outcome: MigrationOutcome) -> MigrationOutcome:
        """The outcome recorded (`workflows.recording`), answered by `outcome` from then on; the run
        then stays open for the job's late window."""
        self._disposition = outcome.disposition
        attest = workflow.patched(ATTESTED)
        self._outcome = await record_outcome(self._steps, self._contract, ref, outcome, attest)
        if self._late_window > 0 and workflow.patched(LATE):
            # Open a while: evidence that comes after the outcome (a NotReady 40 s after the node
            # died) is signalled here by the job, into this history; the outcome stands (`outcome`
            # answers it).
            await asyncio.sleep(self._late_window)
        return self._outcome
