"""MigrationWorkflow checks what the job answers before it records a live migration, and records
what the job measured: a proof that disagrees with itself, a rank resuming at another step, no spare
measured at confirmation, a classifier that fails. The job side is `fake_job.FakeJob` on the
time-skipping server."""

from __future__ import annotations

from datetime import timedelta

from temporalio.testing import WorkflowEnvironment

from tests.workflows.fake_job import T0, FakeJob, incident
from torchpass.models import Category, Disposition, FailureKind, Phase


async def test_a_receiver_holding_other_bytes_fails_the_migration(
    env: WorkflowEnvironment, name: str
) -> None:
    """The job's transfer claims success, but the receiver's own digest of what it installed differs
    from the donor's: not a live migration. The spare goes back, the job restarts from a
    checkpoint."""
    job = FakeJob(wrong_byte=True)
    outcome, _ = await incident(env, job, name)
    assert outcome.disposition == Disposition.FALLBACK_RESTART and not outcome.success
    assert (
        outcome.error
        and "proof does not hold" in outcome.error
        and "rank 2 holds state" in outcome.error
    )
    assert job.calls["rejoin"] == 0 and job.calls["release"] == 1 and job.calls["restart"] == 1
    assert outcome.classification.qualifying  # our failure to migrate it counts against us


async def test_a_receiver_at_another_step_fails_the_migration(
    env: WorkflowEnvironment, name: str
) -> None:
    job = FakeJob(wrong_step=True)
    outcome, _ = await incident(env, job, name)
    assert outcome.disposition == Disposition.FALLBACK_RESTART and not outcome.success
    assert outcome.error and "rank 2 holds step 8 once installed, not 9" in outcome.error


async def test_a_rank_resuming_at_another_step_fails_the_migration(
    env: WorkflowEnvironment, name: str
) -> None:
    job = FakeJob(resume_elsewhere=True)
    outcome, _ = await incident(env, job, name)
    assert outcome.disposition == Disposition.FALLBACK_RESTART and not outcome.success
    assert outcome.error and "rank 2 resumed at step 11, not at step 10" in outcome.error
    assert job.calls["rejoin"] == 1 and job.calls["release"] == 1


async def test_the_outcome_carries_the_steps_the_job_measured(
    env: WorkflowEnvironment, name: str
) -> None:
    # falls back: the restarted ranks resumed at step 5, the job had done 9
    job = FakeJob(transfer=True)
    outcome, _ = await incident(env, job, name)
    assert outcome.steps_recomputed == 5 and outcome.step_before == 9
    assert outcome.resumed_steps == dict.fromkeys(range(4), 5)
    live, _ = await incident(env, FakeJob(), f"{name}_live")
    assert live.success and live.steps_recomputed == 0 and live.step_before == 9
    assert live.resumed_steps == dict.fromkeys(range(4), 10)


async def test_no_spare_measured_at_confirmation_disqualifies_before_any_reservation(
    env: WorkflowEnvironment, name: str
) -> None:
    job = FakeJob(no_spare_at_confirm=True)
    outcome, _ = await incident(env, job, name)
    assert outcome.classification.category == Category.UNABLE_TO_RECOVER
    assert "spare" in outcome.classification.reason and not outcome.classification.qualifying
    assert job.calls["reserve"] == 0 and job.calls["restart"] == 1
    assert outcome.disposition == Disposition.FALLBACK_RESTART


async def test_a_spare_lost_after_confirmation_is_classified_by_the_classifier(
    env: WorkflowEnvironment, name: str
) -> None:
    """Confirmation saw a spare, the reservation found none: the classifier, not the workflow, says
    what that means; its two runs are timed as one phase."""
    job = FakeJob(no_spare=True)
    outcome, _ = await incident(env, job, name)
    assert outcome.classification.category == Category.UNABLE_TO_RECOVER
    assert outcome.classification.kind == FailureKind.PROCESS_EXIT
    assert [p.phase for p in outcome.phases].count(Phase.CLASSIFY) == 1


async def test_a_failed_classifier_leaves_the_failure_unclassified_and_qualifying(
    env: WorkflowEnvironment, name: str
) -> None:
    job = FakeJob()
    outcome, _ = await incident(env, job, name, classify_fails=True)
    assert (
        outcome.classification.category == Category.UNCLASSIFIED
        and outcome.classification.qualifying
    )
    assert "classification table failed to load" in outcome.classification.reason
    # the first report's kind: no table read in the workflow
    assert outcome.kind == FailureKind.PROCESS_EXIT
    assert outcome.success and outcome.disposition == Disposition.MIGRATED


async def test_a_hang_is_timed_from_the_last_progress_as_well(
    env: WorkflowEnvironment, name: str
) -> None:
    last = T0 - timedelta(seconds=2)
    outcome, _ = await incident(env, FakeJob(), name, kinds=(FailureKind.HANG,), last_progress=last)
    assert outcome.recovery_seconds == 1.0  # from detection
    assert outcome.last_progress_at == last and outcome.recovery_from_last_progress_seconds == 3.0
