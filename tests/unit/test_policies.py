"""The error vocabulary and the retry and timeout policies built from it."""

from __future__ import annotations

from torchpass.errors import INCIDENT_ERRORS, RETRYABLE, ErrorType, TorchpassError, non_retryable
from torchpass.ids import ControlActivity, JobActivity, JobActivityV0
from torchpass.policies import ACTIVITY_TIMEOUTS, MIGRATION_RETRY
from workflows.policy import retry_policy


def test_retries_start_fast_and_stop_soon() -> None:
    policy = retry_policy(MIGRATION_RETRY)
    assert policy.initial_interval.total_seconds() == 0.2
    assert policy.maximum_attempts is not None and 3 <= policy.maximum_attempts <= 5


def test_errors_no_retry_can_cure_are_not_retried() -> None:
    permanent = {
        ErrorType.NO_SPARE,
        ErrorType.JOB_GONE,
        ErrorType.NO_CHECKPOINT,
        ErrorType.INVALID_INPUT,
    }
    assert {t.value for t in permanent} <= set(MIGRATION_RETRY.non_retryable)
    assert retry_policy(MIGRATION_RETRY).non_retryable_error_types == list(
        MIGRATION_RETRY.non_retryable
    )
    # A transfer or rejoin may succeed on another attempt (another donor, a re-formed group).
    assert ErrorType.TRANSFER_FAILED.value not in MIGRATION_RETRY.non_retryable


def test_the_non_retryable_lists_are_built_from_the_vocabulary() -> None:
    assert set(MIGRATION_RETRY.non_retryable) == {
        t.value for t in INCIDENT_ERRORS if t not in RETRYABLE
    }
    assert non_retryable([ErrorType.TIMEOUT, ErrorType.PROOF_MISMATCH]) == ("ProofMismatch",)


def test_a_typed_error_takes_its_retry_decision_from_its_type() -> None:
    assert TorchpassError("x", ErrorType.TRANSFER_FAILED).retryable
    assert not TorchpassError("x", ErrorType.PROOF_MISMATCH).retryable
    assert not TorchpassError("x").retryable  # an untyped one is bad input: never retried


def test_every_activity_is_bounded_per_attempt_and_in_total() -> None:
    job = {v for c in (JobActivity, JobActivityV0) for k, v in vars(c).items() if k.isupper()}
    names = job | {ControlActivity.CLASSIFY_FAILURE}
    assert set(ACTIVITY_TIMEOUTS) == names
    for name, t in ACTIVITY_TIMEOUTS.items():
        assert 0 < t.start_to_close.total_seconds() <= t.schedule_to_close.total_seconds(), name
    assert ACTIVITY_TIMEOUTS[JobActivity.TRANSFER_STATE].heartbeat is not None
