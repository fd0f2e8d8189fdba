"""MigrationWorkflow's orchestration, on the time-skipping server, with the job side replaced by
fakes.

The fakes are registered under the real activity names on a per-test job queue; the real
classification activity runs with the workflow on the control queue. The job worker starts only
after every report was sent, so reports always arrive while the first step is pending, as they do
when a node dies. With TORCHPASS_SAVE_HISTORIES=1 each test saves its history to
tests/histories/<test name>.json for the replay test.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections import Counter
from datetime import timedelta

import pytest
from temporalio.common import SearchAttributeKey
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from tests.workflows.fake_job import (
    T0,
    FakeJob,
    control_worker,
    finish,
    incident,
    proof_of,
    report,
    save_history,
    signal_with_start,
)
from torchpass.contract.credit import Money
from torchpass.contract.terms import ContractTerms
from torchpass.errors import ErrorType
from torchpass.ids import (
    CONTROL_TASK_QUEUE,
    SA_JOB_ID,
    SA_KIND,
    SA_OUTCOME,
    SA_QUALIFYING,
    IncidentMessage,
    JobActivity,
)
from torchpass.incident.outcome import MigrationOutcome
from torchpass.models import Category, ContractRef, Disposition, FailureKind, FailureReport, Phase
from torchpass.policies import ACTIVITY_TIMEOUTS, JOB_PICKUP, MIGRATION_RETRY
from workers import contract_client as cc
from workflows.migration import MigrationWorkflow


async def test_a_confirmed_failure_is_migrated_live(env: WorkflowEnvironment, name: str) -> None:
    job = FakeJob()
    outcome, (handle,) = await incident(env, job, name)
    assert outcome.disposition == Disposition.MIGRATED and outcome.success
    assert (
        outcome.steps_recomputed == 0 and outcome.proof == proof_of() and outcome.fallback is None
    )
    assert (
        outcome.classification.qualifying
        and outcome.classification.category == Category.INTERRUPTION
    )
    assert (
        outcome.kind == FailureKind.PROCESS_EXIT and outcome.covered and outcome.lost_slots == (2,)
    )
    assert [p.phase for p in outcome.phases] == [
        Phase.DETECT,
        Phase.CONFIRM,
        Phase.CLASSIFY,
        Phase.RESERVE,
        Phase.FREEZE,
        Phase.TRANSFER,
        Phase.REJOIN,
        Phase.RECORD,
    ]
    timed = {p.phase: p for p in outcome.phases}
    assert timed[Phase.TRANSFER].work_seconds == 0.01 and timed[Phase.DETECT].seconds >= 0
    assert outcome.recovered_at == T0 + timedelta(seconds=1) and outcome.recovery_seconds == 1.0
    assert outcome.incident_id == f"{handle.id}/{handle.result_run_id}" and outcome.error is None
    assert job.calls["release"] == 0 and job.calls["restart"] == 0
    assert [o.model_copy(update={"phases": outcome.phases}) for o in job.completed] == [outcome]
    attrs = (await handle.describe()).typed_search_attributes
    assert attrs.get(SearchAttributeKey.for_keyword(SA_JOB_ID)) == outcome.job_id
    assert attrs.get(SearchAttributeKey.for_keyword(SA_KIND)) == "process_exit"
    assert attrs.get(SearchAttributeKey.for_keyword(SA_OUTCOME)) == "migrated"
    assert attrs.get(SearchAttributeKey.for_keyword(SA_QUALIFYING)) == "true"


async def test_an_incident_the_job_handled_itself_is_filed_from_its_record(
    env: WorkflowEnvironment, name: str
) -> None:
    """The control plane was away when the rank died, so the job carried the steps out itself: it
    refuses the workflow the steps (`HandledLocally`) and the workflow files the job's record
    instead, classified here and its proof checked here, with the job's own timings; nothing is run
    a second time."""
    job = FakeJob(local=True)
    outcome, _ = await incident(env, job, name)
    assert (
        outcome.disposition is Disposition.MIGRATED and outcome.success and outcome.handled_locally
    )
    assert (
        outcome.proof == proof_of() and outcome.steps_recomputed == 0 and outcome.lost_slots == (2,)
    )
    assert (
        outcome.classification.qualifying
        and outcome.classification.category is Category.INTERRUPTION
    )
    assert outcome.recovered_at == T0 + timedelta(seconds=7) and outcome.recovery_seconds == 7.0
    timed = {p.phase: p.seconds for p in outcome.phases}
    assert list(timed) == [Phase.DETECT, Phase.TRANSFER, Phase.CLASSIFY, Phase.RECORD]
    # the job's clock: detect -> began
    assert timed[Phase.DETECT] == 5.0 and timed[Phase.TRANSFER] == 0.5
    assert job.calls == Counter({"confirm": 1, "recorded": 1, "complete": 1})
    assert [o.handled_locally for o in job.completed] == [True]


async def test_a_local_record_whose_proof_does_not_hold_is_a_failure_not_a_success(
    env: WorkflowEnvironment, name: str
) -> None:
    """A record of a live migration whose receiver installed other bytes than the donor's: the
    workflow checks it as it checks a migration it ran, and records a failure with why, never a
    success."""
    job = FakeJob(local_forged=True)
    outcome, _ = await incident(env, job, name)
    assert (
        outcome.disposition is Disposition.FAILED
        and not outcome.success
        and outcome.handled_locally
    )
    assert outcome.error and "does not hold" in outcome.error and outcome.proof is None
    assert job.calls["restart"] == 0 and job.calls["complete"] == 1


async def test_a_job_that_handled_an_incident_but_gives_no_record_is_a_failure_on_the_record(
    env: WorkflowEnvironment, name: str
) -> None:
    job = FakeJob(local_no_record=True)
    outcome, _ = await incident(env, job, name)
    assert outcome.disposition is Disposition.FAILED and outcome.handled_locally
    # torchpass's own failure never disqualifies the customer's
    assert outcome.classification.qualifying
    assert outcome.error and "gave no record" in outcome.error
    assert job.calls["recorded"] == 1 and job.calls["restart"] == 0 and job.calls["complete"] == 1


async def test_no_spare_disqualifies_and_falls_back_to_a_checkpoint_restart(
    env: WorkflowEnvironment, name: str
) -> None:
    job = FakeJob(no_spare=True)
    outcome, (handle,) = await incident(env, job, name)
    assert outcome.disposition == Disposition.FALLBACK_RESTART and not outcome.success
    assert outcome.classification.category == Category.UNABLE_TO_RECOVER
    assert not outcome.classification.qualifying and "no spare" in outcome.classification.reason
    assert outcome.steps_recomputed == 5 and outcome.fallback is not None
    assert job.calls["reserve"] == 1 and job.calls["freeze"] == 0 and job.calls["restart"] == 1
    assert job.calls["release"] == 0  # nothing was reserved, nothing to give back (and never twice)
    attrs = (await handle.describe()).typed_search_attributes
    assert attrs.get(SearchAttributeKey.for_keyword(SA_QUALIFYING)) == "false"
    assert attrs.get(SearchAttributeKey.for_keyword(SA_OUTCOME)) == "fallback_restart"


async def test_spare_is_released_when_transfer_keeps_failing(
    env: WorkflowEnvironment, name: str
) -> None:
    job = FakeJob(transfer=True)
    outcome, _ = await incident(env, job, name)
    # retried to the policy's limit, no further
    assert job.calls["transfer"] == MIGRATION_RETRY.attempts
    assert job.calls["release"] == 1 and job.calls["restart"] == 1 and job.calls["rejoin"] == 0
    assert outcome.disposition == Disposition.FALLBACK_RESTART and not outcome.success
    # a qualifying failure we failed to migrate: counts against us
    assert outcome.classification.qualifying
    assert outcome.fallback is not None and outcome.steps_recomputed == 5
    assert outcome.recovered_at == T0 + timedelta(seconds=30)
    assert outcome.error and "donor lost mid-transfer" in outcome.error
    assert Phase.TRANSFER in {p.phase for p in outcome.phases}


async def test_a_failed_fallback_is_recorded_as_failed(env: WorkflowEnvironment, name: str) -> None:
    job = FakeJob(transfer=True, fallback=True)
    outcome, _ = await incident(env, job, name)
    assert outcome.disposition == Disposition.FAILED and not outcome.success
    assert outcome.error and "no checkpoint" in outcome.error
    assert outcome.recovered_at is None and outcome.recovery_seconds is None
    assert job.calls["release"] == 1 and job.calls["complete"] == 1


async def test_duplicate_and_correlated_reports_fold_into_one_incident(
    env: WorkflowEnvironment, name: str
) -> None:
    job = FakeJob()
    kinds = (FailureKind.CONNECTION_LOST, FailureKind.PROCESS_EXIT, FailureKind.NODE_POWER_LOSS)
    outcome, handles = await incident(env, job, name, kinds=(*kinds, FailureKind.PROCESS_EXIT))
    assert len({h.result_run_id for h in handles}) == 1  # one run: the later starts were signals
    assert job.calls["confirm"] == 1 and job.calls["complete"] == 1
    assert outcome.evidence_count == 3  # the repeated process_exit report was folded away
    assert outcome.kind == FailureKind.NODE_POWER_LOSS
    assert outcome.classification.category == Category.HOST_GPU_FABRIC and outcome.success


async def test_a_malformed_signal_does_not_break_the_incident(
    env: WorkflowEnvironment, name: str
) -> None:
    job = FakeJob()
    job_id = f"job-{uuid.uuid4().hex[:8]}"
    async with control_worker(env):
        handle = await signal_with_start(env, report(job_id))
        await handle.signal(
            IncidentMessage.REPORT, {"evidence": {"kind": "not-a-kind"}, "job_task_queue": 3}
        )
        await handle.signal(
            IncidentMessage.REPORT, report(job_id).model_dump(mode="json") | {"surprise": 1}
        )
        await handle.signal(
            IncidentMessage.REPORT, report("another-job", FailureKind.NODE_POWER_LOSS)
        )
        status = await handle.query(MigrationWorkflow.status)
        assert status.evidence_count == 1 and status.disposition is None
        outcome = await finish(env, handle, job, name, report(job_id).job_task_queue)
        # a closed workflow's query needs a worker
        status = await handle.query(MigrationWorkflow.status)
    assert (
        outcome.success and outcome.evidence_count == 1 and outcome.kind == FailureKind.PROCESS_EXIT
    )
    assert status.phase == Phase.RECORD and status.disposition == Disposition.MIGRATED


async def test_evidence_after_the_outcome_goes_into_the_incidents_history(
    env: WorkflowEnvironment, name: str
) -> None:
    """The job's late window (3 s): the outcome is recorded and answered by `outcome` while the run
    stays open; a NotReady that comes then is signalled to that run, into its history and its count,
    and the outcome stands as recorded. The first report of another incident that lands here (a job
    run again under the same id) is not taken: the job, told the outcome is recorded, moves it to a
    fresh id. Once the window is over the run closes with that outcome, and a later report to it is
    refused."""
    job = FakeJob()
    job_id = f"job-{uuid.uuid4().hex[:8]}"
    first = report(job_id).model_copy(update={"linger_seconds": 3.0})
    late = report(job_id, FailureKind.NODE_NOT_READY).model_copy(
        update={"late": True, "linger_seconds": 3.0}
    )
    async with control_worker(env):
        handle = await signal_with_start(env, first)
        async with Worker(env.client, task_queue=first.job_task_queue, activities=job.activities()):
            recorded = None
            while recorded is None:
                recorded = await handle.query(MigrationWorkflow.outcome)
                await asyncio.sleep(0.05)
            await handle.signal(IncidentMessage.REPORT, late)
            other = report(job_id, FailureKind.PROCESS_EXIT, slot=3).model_copy(
                update={"opens": True}
            )
            await handle.signal(IncidentMessage.REPORT, other)
            status = await handle.query(MigrationWorkflow.status)
            outcome = await asyncio.wait_for(handle.result(), 30)
    # the late one, not the other
    assert status.evidence_count == 2 and recorded.evidence_count == 1
    assert outcome == recorded and outcome.success
    signalled = [
        FailureReport.model_validate_json(
            e.workflow_execution_signaled_event_attributes.input.payloads[0].data
        )
        for e in (await handle.fetch_history()).events
        if e.HasField("workflow_execution_signaled_event_attributes")
    ]
    assert [r.evidence.kind for r in signalled if r.late] == [FailureKind.NODE_NOT_READY]
    with pytest.raises(RPCError):  # closed: a report now goes nowhere, and starts nothing
        await handle.signal(IncidentMessage.REPORT, late)
    await save_history(handle, name)


async def test_a_false_alarm_changes_nothing(env: WorkflowEnvironment, name: str) -> None:
    job = FakeJob(not_confirmed=True)
    outcome, _ = await incident(env, job, name)
    assert outcome.disposition == Disposition.NOT_A_FAILURE and not outcome.success
    assert job.calls["reserve"] == 0 and job.calls["restart"] == 0 and job.calls["complete"] == 1


async def test_a_job_that_cannot_confirm_still_gets_a_restart(
    env: WorkflowEnvironment, name: str
) -> None:
    job = FakeJob(confirm=True)
    outcome, _ = await incident(env, job, name)
    assert job.calls["confirm"] == MIGRATION_RETRY.attempts and job.calls["reserve"] == 0
    assert outcome.disposition == Disposition.FALLBACK_RESTART and not outcome.success
    assert not outcome.covered and outcome.error and "confirm_failure failed" in outcome.error
    assert outcome.classification.qualifying  # our failure to reach the job must not disqualify it


async def test_every_step_is_bounded_in_time_and_retries(
    env: WorkflowEnvironment, name: str
) -> None:
    # The time-skipping server does not skip time while an activity is outstanding, so a job that
    # never answers cannot be waited out here; the history shows that no step could wait forever.
    job = FakeJob(transfer=True)
    outcome, (handle,) = await incident(env, job, name)
    scheduled = [
        e.activity_task_scheduled_event_attributes
        async for e in handle.fetch_history_events()
        if e.HasField("activity_task_scheduled_event_attributes")
    ]
    assert {a.activity_type.name for a in scheduled} >= {
        JobActivity.CONFIRM_FAILURE,
        JobActivity.TRANSFER_STATE,
        JobActivity.RELEASE_SPARE,
        JobActivity.RESTART_FROM_CHECKPOINT,
        JobActivity.COMPLETE_INCIDENT,
    }
    for a in scheduled:
        assert a.start_to_close_timeout.ToSeconds() > 0, a.activity_type.name
        assert 0 < a.schedule_to_close_timeout.ToSeconds() <= 900, a.activity_type.name
        assert 3 <= a.retry_policy.maximum_attempts <= 5
        assert a.retry_policy.initial_interval.ToMilliseconds() == 200
        assert ErrorType.NO_SPARE in a.retry_policy.non_retryable_error_types
        if a.activity_type.name == JobActivity.TRANSFER_STATE:
            assert a.heartbeat_timeout.ToSeconds() > 0
        # a job step: a gone coordinator shows in seconds
        if a.task_queue.name != CONTROL_TASK_QUEUE:
            assert a.schedule_to_start_timeout.ToSeconds() == JOB_PICKUP, a.activity_type.name
    assert outcome.disposition == Disposition.FALLBACK_RESTART


async def test_a_job_that_is_gone_is_not_retried(env: WorkflowEnvironment, name: str) -> None:
    job = FakeJob(gone=True)
    outcome, _ = await incident(env, job, name)
    assert outcome.disposition == Disposition.FAILED
    assert job.calls == Counter(confirm=1, restart=1, complete=1)


async def test_the_outcome_stands_when_the_job_cannot_record_it(
    env: WorkflowEnvironment, name: str
) -> None:
    job = FakeJob(complete=True)
    outcome, _ = await incident(env, job, name)
    assert outcome.success and outcome.disposition == Disposition.MIGRATED
    assert job.calls["complete"] == MIGRATION_RETRY.attempts
    assert outcome.error and "record store unreachable" in outcome.error


async def _contract_incident(
    env: WorkflowEnvironment, name: str, contract: ContractRef, job_id: str
) -> MigrationOutcome:
    at = await env.get_current_time()
    rep = report(job_id, contract=contract, at=at)
    handle = await signal_with_start(env, rep)
    return await finish(env, handle, FakeJob(), name, rep.job_task_queue)


async def test_the_outcome_is_recorded_on_the_jobs_contract(
    env: WorkflowEnvironment, name: str
) -> None:
    ref = ContractRef(customer_id="acme", contract_id=f"c-{uuid.uuid4().hex[:8]}")
    job_id = f"job-{uuid.uuid4().hex[:8]}"
    today = (await env.get_current_time()).date()
    terms = ContractTerms(
        customer_id=ref.customer_id,
        contract_id=ref.contract_id,
        start=today,
        renewal_date=today.replace(year=today.year + 1),
        annual_fee=Money(amount="100000", currency="USD"),
    )
    async with control_worker(env):
        contract = await cc.create_contract(env.client, terms)
        await cc.opt_in(env.client, ref.customer_id, ref.contract_id, job_id)
        outcome = await _contract_incident(env, name, ref, job_id)
        for _ in range(200):  # counted once the real check read the incident's own history
            standing = await cc.get_standing(env.client, ref.customer_id, ref.contract_id)
            if standing.unverified == 0:
                break
            await asyncio.sleep(0.05)
        page = await cc.get_ledger(env.client, ref.customer_id, ref.contract_id)
        # its timers would wake it on the shared control queue
        await contract.terminate("test done")
    assert standing.rejected_claims == 0 and page.rejected == ()
    assert outcome.success and outcome.error is None
    assert [(r.incident_id, r.job_id) for r in page.rows] == [(outcome.incident_id, job_id)]
    assert not page.rows[0].counted  # opted in but never validated: kept, excluded, with its reason
    assert page.rows[0].reason


async def test_a_contract_that_is_not_running_is_an_error_the_outcome_keeps(
    env: WorkflowEnvironment, name: str
) -> None:
    ref = ContractRef(customer_id="acme", contract_id="never-created")
    async with control_worker(env):
        outcome = await _contract_incident(env, name, ref, f"job-{uuid.uuid4().hex[:8]}")
    assert outcome.success and outcome.disposition == Disposition.MIGRATED
    assert outcome.error and "not recorded on contract never-created" in outcome.error


async def test_an_incident_whose_job_is_gone_ends_on_the_record_within_a_minute(
    env: WorkflowEnvironment, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The coordinator killed (Ctrl-C, SIGKILL) with its incident open: nobody serves the job's task
    queue. Each job step nobody takes ends after JOB_PICKUP (never retried), so the incident ends
    failed, with why, within about a minute; on the previous main it stayed RUNNING for every step's
    schedule-to-close (19 minutes once). The time-skipping server does not skip an outstanding
    activity's time, so the test takes the pickup bound as 2 s."""
    pickup = timedelta(seconds=2)
    for step, t in list(ACTIVITY_TIMEOUTS.items()):
        if t.schedule_to_start is not None:
            monkeypatch.setitem(
                ACTIVITY_TIMEOUTS, step, dataclasses.replace(t, schedule_to_start=pickup)
            )
    job_id = f"job-{uuid.uuid4().hex[:8]}"
    async with control_worker(env):
        handle = await signal_with_start(env, report(job_id))  # and no worker on the job's queue
        outcome: MigrationOutcome = await asyncio.wait_for(handle.result(), 60)
        described = await handle.describe()
        await save_history(handle, name)
    assert outcome.disposition is Disposition.FAILED and not outcome.success
    assert outcome.error and "confirm_failure failed" in outcome.error
    assert described.close_time and described.start_time
    took = described.close_time - described.start_time
    assert took < 4 * pickup, took  # confirm, the restart, the record: one pickup each
    assert JOB_PICKUP <= 30  # and in production a minute and a half at most
