"""Pure decisions of the migration workflow: what to do after classification, and how hard to retry.

No I/O and no workflow calls, so they are unit-tested without Temporal. The retry policies and timeouts
live here, beside the decision they serve, so that a change to them is one reviewed diff; the workflow
only looks them up by activity name.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from enum import StrEnum

from temporalio.common import RetryPolicy

from torchpass.ids import ControlActivity, ErrorType, JobActivity
from torchpass.models import Category, Classification, ConfirmResult


class RecoveryAction(StrEnum):
    MIGRATE = "migrate"
    FALLBACK = "fallback"
    NOTHING = "nothing"


def plan_recovery(classification: Classification, confirm: ConfirmResult) -> RecoveryAction:
    """Nothing for a false alarm; a checkpoint restart where live migration cannot help; else migrate."""
    if not confirm.confirmed:
        return RecoveryAction.NOTHING
    if classification.category in (Category.UNABLE_TO_RECOVER, Category.SHARED_INFRASTRUCTURE):
        return RecoveryAction.FALLBACK
    return RecoveryAction.MIGRATE


# Errors that no retry can cure. The job agent also raises "UnknownIncident" and "FreezeFailed" (its own
# kinds, marked non-retryable on the error itself); listing them keeps the policy honest on its own.
NON_RETRYABLE_ERROR_TYPES: tuple[str, ...] = (
    ErrorType.NO_SPARE,
    ErrorType.JOB_GONE,
    ErrorType.NO_CHECKPOINT,
    ErrorType.INVALID_INPUT,
    "UnknownIncident",
    "FreezeFailed",
)

# A recovery is measured in seconds: retry fast (0.2 s) and few times, then fall back rather than wait.
RETRY_INITIAL_INTERVAL = timedelta(milliseconds=200)
RETRY_MAX_ATTEMPTS = 3
RETRY_POLICY = RetryPolicy(
    initial_interval=RETRY_INITIAL_INTERVAL,
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=5),
    maximum_attempts=RETRY_MAX_ATTEMPTS,
    non_retryable_error_types=list(NON_RETRYABLE_ERROR_TYPES),
)


@dataclass(frozen=True)
class ActivityTimeouts:
    """start_to_close bounds one attempt; schedule_to_close bounds all of them, so that a job whose
    coordinator (the worker of its task queue) is gone cannot leave an incident waiting forever."""

    start_to_close: timedelta
    schedule_to_close: timedelta
    heartbeat: timedelta | None = None


def _t(start: float, total: float, heartbeat: float | None = None) -> ActivityTimeouts:
    hb = timedelta(seconds=heartbeat) if heartbeat is not None else None
    return ActivityTimeouts(timedelta(seconds=start), timedelta(seconds=total), hb)


ACTIVITY_TIMEOUTS: dict[str, ActivityTimeouts] = {
    JobActivity.CONFIRM_FAILURE: _t(15, 60),
    ControlActivity.CLASSIFY_FAILURE: _t(10, 60),
    JobActivity.RESERVE_SPARE: _t(90, 200),  # may wait for a spare that is still warming up
    JobActivity.RELEASE_SPARE: _t(15, 60),
    JobActivity.FREEZE_RANKS: _t(45, 150),
    JobActivity.TRANSFER_STATE: _t(150, 500, heartbeat=20),  # streams state, heartbeats its progress
    JobActivity.REJOIN: _t(150, 500),
    JobActivity.RESTART_FROM_CHECKPOINT: _t(300, 900),
    JobActivity.COMPLETE_INCIDENT: _t(15, 60),
    JobActivity.DESCRIBE_JOB: _t(10, 20),  # validation: a job that does not answer soon is not covered
}
