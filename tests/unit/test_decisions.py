"""The workflow's pure decisions: what follows a classification, and how hard each step is retried."""

from __future__ import annotations

import pytest

from torchpass.decisions import (
    ACTIVITY_TIMEOUTS,
    NON_RETRYABLE_ERROR_TYPES,
    RETRY_POLICY,
    RecoveryAction,
    plan_recovery,
)
from torchpass.ids import ControlActivity, ErrorType, JobActivity
from torchpass.models import QUALIFYING_CATEGORIES, Category, Classification, ConfirmResult


def confirm(confirmed: bool = True) -> ConfirmResult:
    return ConfirmResult(
        confirmed=confirmed,
        lost_slots=(1,),
        fenced_slots=(1,),
        world_size=4,
        redundancy=4,
        generation=0,
        covered=True,
    )


def classification(category: Category) -> Classification:
    return Classification(category=category, qualifying=category in QUALIFYING_CATEGORIES, reason="r")


@pytest.mark.parametrize("category", sorted(QUALIFYING_CATEGORIES))
def test_a_confirmed_qualifying_failure_is_migrated(category: Category) -> None:
    assert plan_recovery(classification(category), confirm()) is RecoveryAction.MIGRATE


@pytest.mark.parametrize("category", [Category.SHARED_INFRASTRUCTURE, Category.UNABLE_TO_RECOVER])
def test_a_confirmed_disqualified_failure_falls_back_to_a_restart(category: Category) -> None:
    assert plan_recovery(classification(category), confirm()) is RecoveryAction.FALLBACK


@pytest.mark.parametrize("category", list(Category))
def test_an_unconfirmed_report_changes_nothing(category: Category) -> None:
    assert plan_recovery(classification(category), confirm(confirmed=False)) is RecoveryAction.NOTHING


def test_retries_start_fast_and_stop_soon() -> None:
    assert RETRY_POLICY.initial_interval.total_seconds() == 0.2
    assert RETRY_POLICY.maximum_attempts is not None and 3 <= RETRY_POLICY.maximum_attempts <= 5


def test_errors_no_retry_can_cure_are_not_retried() -> None:
    permanent = {ErrorType.NO_SPARE, ErrorType.JOB_GONE, ErrorType.NO_CHECKPOINT, ErrorType.INVALID_INPUT}
    assert permanent <= set(NON_RETRYABLE_ERROR_TYPES)
    assert RETRY_POLICY.non_retryable_error_types == list(NON_RETRYABLE_ERROR_TYPES)
    # A transfer or rejoin may succeed on another attempt (another donor, a re-formed group).
    assert ErrorType.TRANSFER_FAILED not in NON_RETRYABLE_ERROR_TYPES


def test_every_activity_is_bounded_per_attempt_and_in_total() -> None:
    names = {v for k, v in vars(JobActivity).items() if k.isupper()} | {ControlActivity.CLASSIFY_FAILURE}
    assert set(ACTIVITY_TIMEOUTS) == names
    for name, t in ACTIVITY_TIMEOUTS.items():
        assert 0 < t.start_to_close.total_seconds() <= t.schedule_to_close.total_seconds(), name
    assert ACTIVITY_TIMEOUTS[JobActivity.TRANSFER_STATE].heartbeat is not None
