"""How hard each workflow step is retried and how long it may take: plain data, one reviewed place.

No Temporal here: the workflows turn a `Retry` into temporalio's `RetryPolicy` (`workflows.policy`),
so the core stays importable by the job agent, which never imports Temporal. The non-retryable lists
are built from the error vocabulary (`torchpass.errors`), where each type's retry decision is made.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from torchpass.errors import INCIDENT_ERRORS, ErrorType, non_retryable
from torchpass.ids import ControlActivity, JobActivity, JobActivityV0, ValidationActivity


@dataclass(frozen=True)
class Retry:
    """Exponential backoff from `initial` up to `maximum`; `attempts` 0 means until it succeeds."""

    initial: timedelta
    backoff: float
    maximum: timedelta
    attempts: int
    non_retryable: tuple[str, ...]


@dataclass(frozen=True)
class ActivityTimeouts:
    """start_to_close bounds one attempt; schedule_to_close bounds all of them, so that a job whose
    coordinator (the worker of its task queue) is gone cannot leave an incident waiting forever."""

    start_to_close: timedelta
    schedule_to_close: timedelta
    heartbeat: timedelta | None = None
    schedule_to_start: timedelta | None = None


def _t(
    start: float, total: float, heartbeat: float | None = None, pickup: float | None = None
) -> ActivityTimeouts:
    hb = timedelta(seconds=heartbeat) if heartbeat is not None else None
    to_start = timedelta(seconds=pickup) if pickup is not None else None
    return ActivityTimeouts(timedelta(seconds=start), timedelta(seconds=total), hb, to_start)


# --- an incident: seconds matter, so retry fast (0.2 s) and few times, then fall back rather than
# wait ---

MIGRATION_RETRY = Retry(
    initial=timedelta(milliseconds=200),
    backoff=2.0,
    maximum=timedelta(seconds=5),
    attempts=3,
    non_retryable=non_retryable(INCIDENT_ERRORS),
)

# Every job-side step heartbeats each second (activities/job.py): a job worker or a server lost
# mid-step is noticed after HEARTBEAT seconds and the step retried, instead of at its whole
# start-to-close.
HEARTBEAT = 5.0
# A job's steps run in its coordinator, which takes a task within milliseconds: one nobody takes for
# this long means the coordinator is gone (killed, Ctrl-C), and the incident ends on the record
# within a minute or so instead of waiting out every step's schedule-to-close (19 minutes once). Not
# retried: no retry can bring a dead coordinator back.
JOB_PICKUP = 20.0
# A control worker caches each workflow it runs and gets its next task on its own (sticky) queue;
# the server hands the task to any worker only once it waited this long. Temporal's 10 s default was
# the cost of a control worker killed mid-incident; a busy worker that misses it costs a replay,
# nothing more.
STICKY_PICKUP = timedelta(seconds=2)
# An incident's workflow task taken by a control worker that dies before finishing it is given to
# another after this long (Temporal's default, 10 s, was what a control worker killed 0.5 s into an
# incident cost: 9.1 s). A task takes milliseconds; the first on a fresh worker, imports included,
# well under a second.
INCIDENT_TASK_TIMEOUT = timedelta(seconds=4)
ACTIVITY_TIMEOUTS: dict[str, ActivityTimeouts] = {
    JobActivity.CONFIRM_FAILURE: _t(15, 60, HEARTBEAT, JOB_PICKUP),
    ControlActivity.CLASSIFY_FAILURE: _t(10, 60),
    # may wait for a spare still warming up
    JobActivity.RESERVE_SPARES: _t(90, 200, HEARTBEAT, JOB_PICKUP),
    JobActivity.RELEASE_SPARE: _t(15, 60, HEARTBEAT, JOB_PICKUP),
    JobActivity.FREEZE_RANKS: _t(45, 150, HEARTBEAT, JOB_PICKUP),
    # streams state, heartbeats bytes sent
    JobActivity.TRANSFER_STATE: _t(150, 500, HEARTBEAT, JOB_PICKUP),
    JobActivity.REJOIN: _t(150, 500, HEARTBEAT, JOB_PICKUP),
    JobActivity.RESTART_FROM_CHECKPOINT: _t(300, 900, HEARTBEAT, JOB_PICKUP),
    JobActivity.COMPLETE_INCIDENT: _t(15, 60, HEARTBEAT, JOB_PICKUP),
    # A job that does not sign soon leaves its outcome unconfirmed (never counted), not unrecorded.
    JobActivity.ATTEST_OUTCOME: _t(10, 30, HEARTBEAT, JOB_PICKUP),
    # Waits while the job's own recovery still runs (as long as a transfer and a rejoin may take).
    JobActivity.FETCH_LOCAL_RECORD: _t(600, 900, HEARTBEAT, JOB_PICKUP),
    # validation: a job that does not answer soon is not covered
    JobActivity.DESCRIBE_JOB: _t(10, 20),
}
ACTIVITY_TIMEOUTS[JobActivityV0.RESERVE_SPARE] = ACTIVITY_TIMEOUTS[JobActivity.RESERVE_SPARES]
ACTIVITY_TIMEOUTS[JobActivityV0.RECORDED_OUTCOME] = ACTIVITY_TIMEOUTS[
    JobActivity.FETCH_LOCAL_RECORD
]

# --- credits: billing may be down for days; retried until it acknowledges
# ---------------------------

BILLING_RETRY = Retry(
    initial=timedelta(seconds=1),
    backoff=2.0,
    maximum=timedelta(minutes=5),
    attempts=0,
    non_retryable=non_retryable(
        (
            ErrorType.BILLING_REJECTED,
            ErrorType.BILLING_NOT_CONFIGURED,
            ErrorType.BILLING_UNAVAILABLE,
        )
    ),
)
"""Exponential from 1 s up to 5 min between attempts, no attempt limit; only a refusal no retry can
cure stops it. Re-issuing the same notice is safe: billing deduplicates on its idempotency key."""

BILLING_TIMEOUTS = ActivityTimeouts(
    start_to_close=timedelta(seconds=60),
    schedule_to_close=timedelta(days=7),
    heartbeat=timedelta(seconds=30),
)
MAX_WEBHOOK_TIMEOUT_S = 25.0
"""One webhook attempt blocks at most this long: under BILLING_TIMEOUTS' heartbeat timeout."""

# --- environment validation: a few patient retries; a job that does not answer is a failed check
# ----

VALIDATION_RETRY = Retry(
    initial=timedelta(seconds=1),
    backoff=2.0,
    maximum=timedelta(seconds=10),
    attempts=3,
    non_retryable=non_retryable((ErrorType.INVALID_INPUT,)),
)
VALIDATION_TIMEOUTS: dict[str, ActivityTimeouts] = {
    ValidationActivity.CHECK_CONTROL_PLANE: _t(30, 90),
    ValidationActivity.DETECT_SCHEDULER: _t(40, 120),
    ValidationActivity.RECORD_VALIDATION: _t(15, 60),
}
DESCRIBE_ATTEMPT = timedelta(seconds=10)
"""One describe_job attempt; the overall deadline is the validation input's short
`job_timeout_s`."""

# --- the ledger's checks: reading a claimed workflow's history; retried while the server is away
# -----

VERIFY_RETRY = Retry(
    initial=timedelta(seconds=1),
    backoff=2.0,
    maximum=timedelta(minutes=1),
    attempts=0,
    non_retryable=non_retryable((ErrorType.INVALID_INPUT,)),
)
VERIFY_TIMEOUTS: dict[str, ActivityTimeouts] = {
    # Outcomes wait in the contract's state: a check that cannot run for ten minutes is tried again
    # later.
    ControlActivity.VERIFY_OUTCOMES: _t(60, 600, heartbeat=20),
    # A validation waits in its update: its caller (the validation workflow) retries the whole
    # update.
    ControlActivity.VERIFY_VALIDATION: _t(20, 45),
}
VERIFY_AGAIN_AFTER = timedelta(minutes=10)
"""When the server could not be read for VERIFY_OUTCOMES' whole schedule: the outcomes stay
queued."""
