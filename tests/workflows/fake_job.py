"""The job side of an incident for MigrationWorkflow's tests, scripted: counts calls, fails where
told to.

Registered under the real activity names on a per-test job queue; the real classification activity
runs with the workflow on the control queue (`control_worker`). Every figure it returns is shaped
like the job's own measurements (receivers' installed digests, the steps the ranks resumed at, the
spares ready).
"""

from __future__ import annotations

import os
import uuid
from collections import Counter
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from temporalio import activity
from temporalio.client import WorkflowHandle
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from activities.control import ControlActivities
from activities.ledger import LedgerActivities
from torchpass.errors import ErrorType
from torchpass.ids import (
    CONTROL_TASK_QUEUE,
    ControlActivity,
    IncidentMessage,
    JobActivity,
    WorkflowName,
    incident_workflow_id,
)
from torchpass.incident.attestation import JobKey
from torchpass.incident.outcome import CompleteInput, MigrationOutcome
from torchpass.incident.steps import (
    ConfirmInput,
    ConfirmResult,
    FallbackInput,
    FallbackResult,
    FreezeResult,
    IncidentRef,
    LocalRecord,
    ReceiverProof,
    RejoinResult,
    ReserveResult,
    TransferProof,
    TransferResult,
)
from torchpass.models import (
    Classification,
    ClassifyInput,
    ContractRef,
    Disposition,
    EventSource,
    Evidence,
    FailureKind,
    FailureReport,
    Phase,
    PhaseTiming,
)
from workflows.contract import ContractWorkflow
from workflows.migration import MigrationWorkflow

HISTORIES = Path(__file__).resolve().parents[1] / "histories"
T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
DOMAIN = "node-7"


class FakeJob:
    """The job side of an incident, scripted: counts calls, fails where told to."""

    def __init__(self, **fail: bool) -> None:
        unknown = set(fail) - {
            "confirm",
            "not_confirmed",
            "no_spare",
            "no_spare_at_confirm",
            "transfer",
            "beyond",  # the transfer's only source was lost: nothing left to move from
            "wrong_byte",
            "wrong_step",
            "resume_elsewhere",
            "fallback",
            "complete",
            "gone",
            "local",  # the job handled it itself (the control plane was away): it refuses the steps
            "local_forged",  # ... and its record claims a live migration whose proof does not hold
            "local_no_record",  # ... and gives no record of it
        }
        assert not unknown, unknown
        self.fail = fail
        self.calls: Counter[str] = Counter()
        self.completed: list[MigrationOutcome] = []
        self.key = JobKey.generate()  # the job's own, its outcomes signed with it

    def _enter(self, name: str) -> None:
        self.calls[name] += 1
        if self.fail.get("gone"):
            raise ApplicationError(
                "coordinator is gone", type=ErrorType.JOB_GONE, non_retryable=True
            )

    def activities(self) -> list[Any]:
        @activity.defn(name=JobActivity.CONFIRM_FAILURE)
        async def confirm(inp: ConfirmInput) -> ConfirmResult:
            self._enter("confirm")
            if self.fail.get("confirm"):
                raise ApplicationError("coordinator unreachable")
            if self._local():
                raise ApplicationError(
                    "handled by the job", type=ErrorType.HANDLED_LOCALLY, non_retryable=True
                )
            return self._confirmed(inp.evidence)

        @activity.defn(name=JobActivity.RESERVE_SPARES)
        async def reserve(inp: IncidentRef) -> ReserveResult:
            self._enter("reserve")
            if self.fail.get("no_spare"):
                raise ApplicationError("0 warm spares", type=ErrorType.NO_SPARE, non_retryable=True)
            return ReserveResult(spare_ids=("spare-1",), work_seconds=0.01)

        @activity.defn(name=JobActivity.RELEASE_SPARE)
        async def release(inp: IncidentRef) -> None:
            self._enter("release")

        @activity.defn(name=JobActivity.FREEZE_RANKS)
        async def freeze(inp: IncidentRef) -> FreezeResult:
            self._enter("freeze")
            return FreezeResult(
                completed_steps={0: 9, 1: 9, 3: 9}, target_step=9, step_before=9, work_seconds=0.01
            )

        @activity.defn(name=JobActivity.TRANSFER_STATE)
        async def transfer(inp: IncidentRef) -> TransferResult:
            self._enter("transfer")
            activity.heartbeat("streaming")
            if self.fail.get("transfer"):
                raise ApplicationError("donor lost mid-transfer", type=ErrorType.TRANSFER_FAILED)
            if self.fail.get("beyond"):
                raise ApplicationError(
                    "no healthy replica of rank 2's shard holds step 9",
                    type=ErrorType.BEYOND_REDUNDANCY,
                    non_retryable=True,
                )
            proof = proof_of(
                installed_digest="e" if self.fail.get("wrong_byte") else "d",
                installed_step=8 if self.fail.get("wrong_step") else 9,
            )
            return TransferResult(proof=proof, work_seconds=0.01)

        @activity.defn(name=JobActivity.REJOIN)
        async def rejoin(inp: IncidentRef) -> RejoinResult:
            self._enter("rejoin")
            resumed = dict.fromkeys(range(4), 10)
            if self.fail.get("resume_elsewhere"):
                resumed[2] = 11
            return RejoinResult(
                generation=1,
                resumed_step=10,
                resumed_at=T0 + timedelta(seconds=1),
                resumed_steps=resumed,
                step_before=9,
                steps_recomputed=0,
            )

        @activity.defn(name=JobActivity.RESTART_FROM_CHECKPOINT)
        async def restart(inp: FallbackInput) -> FallbackResult:
            self._enter("restart")
            if self.fail.get("fallback"):
                raise ApplicationError(
                    "no checkpoint", type=ErrorType.NO_CHECKPOINT, non_retryable=True
                )
            return FallbackResult(
                restored_step=4,
                failed_at_step=9,
                steps_recomputed=5,
                resumed_at=T0 + timedelta(seconds=30),
                resumed_steps=dict.fromkeys(range(4), 5),
            )

        @activity.defn(name=JobActivity.COMPLETE_INCIDENT)
        async def complete(inp: CompleteInput) -> None:
            self._enter("complete")
            if self.fail.get("complete"):
                raise ApplicationError("record store unreachable")
            self.completed.append(inp.outcome)

        @activity.defn(name=JobActivity.ATTEST_OUTCOME)
        async def attest(inp: CompleteInput) -> str:
            self._enter("attest")
            return self.key.attest(inp.outcome)

        @activity.defn(name=JobActivity.FETCH_LOCAL_RECORD)
        async def recorded(inp: IncidentRef) -> LocalRecord:
            self._enter("recorded")
            if self.fail.get("local_no_record"):
                raise ApplicationError(
                    "no record", type=ErrorType.UNKNOWN_INCIDENT, non_retryable=True
                )
            return self._record(activity.info().workflow_id or "", inp.job_id)

        return [
            confirm,
            reserve,
            release,
            freeze,
            transfer,
            rejoin,
            restart,
            complete,
            attest,
            recorded,
        ]

    def _local(self) -> bool:
        return any(self.fail.get(k) for k in ("local", "local_forged", "local_no_record"))

    def _confirmed(self, evidence: Sequence[Evidence]) -> ConfirmResult:
        slots = tuple(sorted({s for e in evidence for s in e.slots}))
        return ConfirmResult(
            confirmed=not self.fail.get("not_confirmed"),
            lost_slots=slots,
            fenced_slots=slots,
            world_size=4,
            redundancy=4,
            shard_of=dict.fromkeys(range(4), "dp-model"),
            spares_ready=0 if self.fail.get("no_spare_at_confirm") else 1,
            generation=0,
            covered=True,
            work_seconds=0.01,
        )

    def _record(self, workflow_id: str, job_id: str) -> LocalRecord:
        """What a job that recovered by itself (detected at T0, began 5 s later, trained again at 7
        s) keeps: a live migration of rank 2, measured as the other fakes measure one."""
        ev = report(job_id).evidence
        rejoin = RejoinResult(
            generation=1,
            resumed_step=10,
            resumed_at=T0 + timedelta(seconds=7),
            resumed_steps=dict.fromkeys(range(4), 10),
            step_before=9,
        )
        return LocalRecord(
            workflow_id=workflow_id,
            evidence=(ev,),
            started_at=T0 + timedelta(seconds=5),
            confirm=self._confirmed((ev,)),
            frozen=FreezeResult(completed_steps={0: 9, 1: 9, 3: 9}, target_step=9, step_before=9),
            disposition=Disposition.MIGRATED,
            proof=proof_of(installed_digest="e" if self.fail.get("local_forged") else "d"),
            rejoin=rejoin,
            phases=(PhaseTiming(phase=Phase.TRANSFER, seconds=0.5),),
        )


def proof_of(installed_digest: str = "d", installed_step: int = 9) -> TransferProof:
    """Donor rank 0 served step 9 (digest "d") to rank 2; ranks 1 and 3 held step 9 already."""
    return TransferProof(
        donor_slot=0,
        donor_step=9,
        receiver_slots=(2,),
        donor_digest="d",
        receiver_digests={2: installed_digest},
        receivers=(
            ReceiverProof(
                slot=2,
                stream_digest="d",
                installed_digest=installed_digest,
                installed_step=installed_step,
            ),
        ),
        survivor_steps={1: 9, 3: 9},
        step_before=9,
        step_after=9,
        bytes=100,
        seconds=0.01,
    )


def report(
    job_id: str,
    kind: FailureKind = FailureKind.PROCESS_EXIT,
    slot: int = 2,
    contract: ContractRef | None = None,
    at: datetime = T0,
    last_progress: datetime | None = None,
) -> FailureReport:
    ev = Evidence(
        kind=kind,
        source=EventSource.COORDINATOR,
        job_id=job_id,
        failure_domain=DOMAIN,
        slots=(slot,),
        detail=f"{kind} on rank {slot}",
        observed_at=at,
        last_progress_at=last_progress,
    )
    return FailureReport(
        evidence=ev, job_task_queue=f"job-queue-{job_id}", generation=0, contract=contract
    )


def control_worker(env: WorkflowEnvironment, classify_fails: bool = False) -> Worker:
    @activity.defn(name=ControlActivity.CLASSIFY_FAILURE)
    async def broken_classifier(inp: ClassifyInput) -> Classification:
        raise ApplicationError(
            "classification table failed to load", type=ErrorType.INVALID_INPUT.value
        )

    classify = broken_classifier if classify_fails else ControlActivities().classify_failure
    # the real checks: contracts here hear from real incidents
    ledger = LedgerActivities(env.client)
    return Worker(
        env.client,
        task_queue=CONTROL_TASK_QUEUE,
        workflows=[MigrationWorkflow, ContractWorkflow],
        activities=[classify, ledger.verify_outcomes, ledger.verify_validation],
    )


async def signal_with_start(
    env: WorkflowEnvironment, rep: FailureReport
) -> WorkflowHandle[Any, Any]:
    return await env.client.start_workflow(
        WorkflowName.MIGRATION,
        rep,
        id=incident_workflow_id(rep.evidence.job_id, rep.evidence.failure_domain, rep.generation),
        task_queue=CONTROL_TASK_QUEUE,
        start_signal=IncidentMessage.REPORT,
        start_signal_args=[rep],
        result_type=MigrationOutcome,
    )


async def finish(
    env: WorkflowEnvironment, handle: WorkflowHandle[Any, Any], job: FakeJob, name: str, queue: str
) -> MigrationOutcome:
    """Serve the job queue, wait for the outcome, save the history if asked."""
    async with Worker(env.client, task_queue=queue, activities=job.activities()):
        outcome: MigrationOutcome = await handle.result()
    await save_history(handle, name)
    return outcome


async def save_history(handle: WorkflowHandle[Any, Any], name: str) -> None:
    """With TORCHPASS_SAVE_HISTORIES=1, save a finished run's history for the replay test."""
    if os.environ.get("TORCHPASS_SAVE_HISTORIES") == "1":
        HISTORIES.mkdir(exist_ok=True)
        (HISTORIES / f"{name}.json").write_text((await handle.fetch_history()).to_json())


async def incident(
    env: WorkflowEnvironment,
    job: FakeJob,
    name: str,
    kinds: Sequence[FailureKind] = (FailureKind.PROCESS_EXIT,),
    classify_fails: bool = False,
    last_progress: datetime | None = None,
) -> tuple[MigrationOutcome, list[WorkflowHandle[Any, Any]]]:
    job_id = f"job-{uuid.uuid4().hex[:8]}"
    async with control_worker(env, classify_fails):
        reports = [report(job_id, kind, last_progress=last_progress) for kind in kinds]
        handles = [await signal_with_start(env, r) for r in reports]
        outcome = await finish(env, handles[0], job, name, report(job_id).job_task_queue)
    return outcome, handles
