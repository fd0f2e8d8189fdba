"""The core's retry and timeout policies (`torchpass.policies`) as temporalio's options."""

from __future__ import annotations

from temporalio.common import RetryPolicy

from torchpass.policies import Retry


def retry_policy(r: Retry) -> RetryPolicy:
    return RetryPolicy(
        initial_interval=r.initial,
        backoff_coefficient=r.backoff,
        maximum_interval=r.maximum,
        maximum_attempts=r.attempts,
        non_retryable_error_types=list(r.non_retryable),
    )
