"""MigrationWorkflow's orchestration, on the time-skipping server, with the job side replaced by fakes.

The fakes are registered under the real activity names on a per-test job queue; the real classification
activity runs on the control queue. With TORCHPASS_SAVE_HISTORIES=1 each test saves its history for the
replay test.
"""

from __future__ import annotations

import os
import uuid
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

from temporalio import activity
from temporalio.client import WorkflowHandle
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from activities.control import ControlActivities
from torchpass.ids import CONTROL_TASK_QUEUE, ErrorType, JobActivity, incident_workflow_id
from torchpass.models import (
    Category,
    CompleteInput,
    ConfirmInput,
    ConfirmResult,
    Disposition,
    EventSource,
    Evidence,
    FailureKind,
    FailureReport,
    FallbackInput,
    FallbackResult,
    FreezeResult,
    IncidentRef,
    MigrationOutcome,
    Phase,
    RejoinResult,
    ReserveResult,
    TransferProof,
    TransferResult,
)
from workflows.migration import MigrationWorkflow

HISTORIES = Path(__file__).resolve().parents[1] / "histories"
T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


class FakeJob:
    """The job side of an incident, scripted: counts calls, fails where told to."""

    def __init__(
        self, spare: bool = True, transfer_fails: bool = False, fallback_fails: bool = False
    ) -> None:
        self.calls: Counter[str] = Counter()
        self.spare, self.transfer_fails, self.fallback_fails = spare, transfer_fails, fallback_fails
        self.completed: list[MigrationOutcome] = []

    def activities(self) -> list:
        @activity.defn(name=JobActivity.CONFIRM_FAILURE)
        async def confirm(inp: ConfirmInput) -> ConfirmResult:
            self.calls["confirm"] += 1
            slots = sorted({s for e in inp.evidence for s in e.slots})
            return ConfirmResult(
                confirmed=True,
                lost_slots=tuple(slots),
                fenced_slots=tuple(slots),
                world_size=4,
                redundancy=4,
                generation=0,
                covered=False,
            )

        @activity.defn(name=JobActivity.RESERVE_SPARE)
        async def reserve(inp: IncidentRef) -> ReserveResult:
            self.calls["reserve"] += 1
            if not self.spare:
                raise ApplicationError("0 warm", type=ErrorType.NO_SPARE, non_retryable=True)
            return ReserveResult(spare_ids=("spare-1",))

        @activity.defn(name=JobActivity.RELEASE_SPARE)
        async def release(inp: IncidentRef) -> None:
            self.calls["release"] += 1

        @activity.defn(name=JobActivity.FREEZE_RANKS)
        async def freeze(inp: IncidentRef) -> FreezeResult:
            self.calls["freeze"] += 1
            return FreezeResult(completed_steps={0: 9, 1: 9, 3: 9}, target_step=9)

        @activity.defn(name=JobActivity.TRANSFER_STATE)
        async def transfer(inp: IncidentRef) -> TransferResult:
            self.calls["transfer"] += 1
            if self.transfer_fails:
                raise ApplicationError("donor lost mid-transfer", type=ErrorType.TRANSFER_FAILED)
            proof = TransferProof(
                donor_slot=0,
                receiver_slots=(2,),
                donor_digest="d",
                receiver_digests={2: "d"},
                step_before=9,
                step_after=9,
                bytes=100,
                seconds=0.01,
            )
            return TransferResult(proof=proof)

        @activity.defn(name=JobActivity.REJOIN)
        async def rejoin(inp: IncidentRef) -> RejoinResult:
            self.calls["rejoin"] += 1
            return RejoinResult(generation=1, resumed_step=10, resumed_at=T0 + timedelta(seconds=1))

        @activity.defn(name=JobActivity.RESTART_FROM_CHECKPOINT)
        async def restart(inp: FallbackInput) -> FallbackResult:
            self.calls["restart"] += 1
            if self.fallback_fails:
                raise ApplicationError("no checkpoint", type=ErrorType.NO_CHECKPOINT, non_retryable=True)
            return FallbackResult(restored_step=4, failed_at_step=9, steps_recomputed=5, resumed_at=T0)

        @activity.defn(name=JobActivity.COMPLETE_INCIDENT)
        async def complete(inp: CompleteInput) -> None:
            self.calls["complete"] += 1
            self.completed.append(inp.outcome)

        return [confirm, reserve, release, freeze, transfer, rejoin, restart, complete]


def _report(
    job_id: str, queue: str, kind: FailureKind = FailureKind.PROCESS_EXIT, slot: int = 2
) -> FailureReport:
    ev = Evidence(
        kind=kind,
        source=EventSource.COORDINATOR,
        job_id=job_id,
        failure_domain="node-7",
        slots=(slot,),
        detail=f"{kind} on rank {slot}",
        observed_at=T0,
    )
    return FailureReport(evidence=ev, job_task_queue=queue, generation=0)


async def _run(
    env: WorkflowEnvironment, job: FakeJob, name: str, reports: int = 1
) -> tuple[MigrationOutcome, WorkflowHandle]:
    job_id = f"job-{uuid.uuid4().hex[:8]}"
    queue = f"job-queue-{job_id}"
    wid = incident_workflow_id(job_id, "node-7", 0)
    kinds = [FailureKind.CONNECTION_LOST, FailureKind.PROCESS_EXIT, FailureKind.NODE_POWER_LOSS][:reports]
    async with (
        Worker(
            env.client,
            task_queue=CONTROL_TASK_QUEUE,
            workflows=[MigrationWorkflow],
            activities=[ControlActivities().classify_failure],
        ),
        Worker(env.client, task_queue=queue, activities=job.activities()),
    ):
        handle = None
        for kind in kinds or [FailureKind.PROCESS_EXIT]:
            rep = _report(job_id, queue, kind)
            handle = await env.client.start_workflow(
                MigrationWorkflow.run,
                rep,
                id=wid,
                task_queue=CONTROL_TASK_QUEUE,
                start_signal="report",
                start_signal_args=[rep],
            )
        assert handle is not None
        outcome = await handle.result()
    if os.environ.get("TORCHPASS_SAVE_HISTORIES") == "1":
        HISTORIES.mkdir(exist_ok=True)
        (HISTORIES / f"{name}.json").write_text((await handle.fetch_history()).to_json())
    return outcome, handle


async def test_a_confirmed_failure_is_migrated_live(env: WorkflowEnvironment) -> None:
    job = FakeJob()
    outcome, _ = await _run(env, job, "migrated")
    assert outcome.disposition == Disposition.MIGRATED and outcome.success
    assert outcome.steps_recomputed == 0 and outcome.proof is not None
    assert outcome.classification.qualifying and outcome.classification.category == Category.INTERRUPTION
    assert [p.phase for p in outcome.phases] == [
        Phase.DETECT,
        Phase.CONFIRM,
        Phase.CLASSIFY,
        Phase.RESERVE,
        Phase.FREEZE,
        Phase.TRANSFER,
        Phase.REJOIN,
    ]
    assert outcome.recovery_seconds is not None
    assert job.calls["release"] == 0 and job.calls["restart"] == 0
    assert job.completed == [outcome]


async def test_no_spare_disqualifies_and_falls_back_to_a_checkpoint_restart(env: WorkflowEnvironment) -> None:
    job = FakeJob(spare=False)
    outcome, _ = await _run(env, job, "no_spare")
    assert outcome.disposition == Disposition.FALLBACK_RESTART and not outcome.success
    assert outcome.classification.category == Category.UNABLE_TO_RECOVER
    assert not outcome.classification.qualifying and "spare" in outcome.classification.reason
    assert outcome.steps_recomputed == 5
    assert job.calls["reserve"] == 1 and job.calls["freeze"] == 0
    assert job.calls["release"] == 0  # nothing was reserved, nothing to give back


async def test_spare_is_released_when_transfer_keeps_failing(env: WorkflowEnvironment) -> None:
    job = FakeJob(transfer_fails=True)
    outcome, _ = await _run(env, job, "transfer_fails")
    assert job.calls["transfer"] == 3  # retried to the policy's limit
    assert job.calls["release"] == 1 and job.calls["restart"] == 1
    assert outcome.disposition == Disposition.FALLBACK_RESTART and not outcome.success
    assert outcome.classification.qualifying  # a qualifying failure we failed to migrate: counts against us
    assert outcome.fallback is not None and outcome.steps_recomputed == 5


async def test_a_failed_fallback_is_recorded_as_failed(env: WorkflowEnvironment) -> None:
    job = FakeJob(transfer_fails=True, fallback_fails=True)
    outcome, _ = await _run(env, job, "fallback_fails")
    assert outcome.disposition == Disposition.FAILED and not outcome.success
    assert outcome.error and "no checkpoint" in outcome.error
    assert job.completed == [outcome]


async def test_duplicate_and_correlated_reports_fold_into_one_incident(env: WorkflowEnvironment) -> None:
    job = FakeJob()
    outcome, handle = await _run(env, job, "correlated", reports=3)
    assert job.calls["confirm"] == 1 and job.calls["complete"] == 1
    assert outcome.evidence_count == 3
    assert outcome.kind == FailureKind.NODE_POWER_LOSS
    assert outcome.classification.category == Category.HOST_GPU_FABRIC
    assert handle.first_execution_run_id is None or outcome.incident_id.endswith(
        handle.first_execution_run_id
    )


async def test_a_malformed_signal_does_not_break_the_incident(env: WorkflowEnvironment) -> None:
    job = FakeJob()
    job_id = f"job-{uuid.uuid4().hex[:8]}"
    queue = f"q-{job_id}"
    rep = _report(job_id, queue)
    async with (
        Worker(
            env.client,
            task_queue=CONTROL_TASK_QUEUE,
            workflows=[MigrationWorkflow],
            activities=[ControlActivities().classify_failure],
        ),
        Worker(env.client, task_queue=queue, activities=job.activities()),
    ):
        handle = await env.client.start_workflow(
            MigrationWorkflow.run,
            rep,
            id=incident_workflow_id(job_id, "node-7", 0),
            task_queue=CONTROL_TASK_QUEUE,
        )
        await handle.signal("report", {"evidence": {"kind": "not-a-kind"}, "job_task_queue": 3})
        outcome = await handle.result()
    assert outcome.success and outcome.evidence_count == 1
