"""The one error vocabulary of torchpass: every typed failure, and whether retrying it can help.

Activities raise `temporalio.exceptions.ApplicationError(type=<ErrorType value>,
non_retryable=...)`; the retry policies (`torchpass.policies`) list the non-retryable types, built
from `RETRYABLE` below, so that an error's retry decision is made once, here, and every layer agrees
on it. The job agent, the contract rules and billing raise subclasses of `TorchpassError`, which
carry their type.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum


class ErrorType(StrEnum):
    """`ApplicationError.type` values. The strings are recorded in workflow histories: never rename
    one."""

    # An incident's job-side steps.
    UNKNOWN_INCIDENT = "UnknownIncident"
    NO_SPARE = "NoSpareAvailable"
    JOB_GONE = "JobGone"
    OUT_OF_ORDER = "StepOutOfOrder"
    FREEZE_FAILED = "FreezeFailed"
    TRANSFER_FAILED = "TransferFailed"
    PROOF_MISMATCH = "ProofMismatch"
    REJOIN_FAILED = "RejoinFailed"
    NO_CHECKPOINT = "NoCheckpoint"
    TIMEOUT = "Timeout"
    INVALID_INPUT = "InvalidInput"
    # The job carried the incident out itself while the control plane was away: the workflow files
    # its record (`fetch_local_record`) instead of running the steps again.
    HANDLED_LOCALLY = "HandledLocally"
    # A recovery's state has no source left (the only replica of a shard, a leaving rank included,
    # was lost before it moved): what happened exceeds the job's redundancy, whatever was planned.
    BEYOND_REDUNDANCY = "BeyondRedundancy"
    # Credit delivery to billing.
    BILLING_UNAVAILABLE = "BillingUnavailable"
    BILLING_REJECTED = "BillingRejected"
    BILLING_NOT_CONFIGURED = "BillingNotConfigured"
    # Contract updates the rules refuse.
    CONTRACT_INVALID_FEE = "ContractInvalidFee"
    CONTRACT_CURRENCY_MISMATCH = "ContractCurrencyMismatch"
    CONTRACT_DATES_OUT_OF_ORDER = "ContractDatesOutOfOrder"
    CONTRACT_UNKNOWN_JOB = "ContractUnknownJob"
    CONTRACT_WRONG_CONTRACT = "ContractWrongContract"
    CONTRACT_INVALID_PAGE = "ContractInvalidPage"
    CONTRACT_AWAITING_RENEWAL = "ContractAwaitingRenewal"
    CONTRACT_ENDED = "ContractEnded"
    CONTRACT_UNVERIFIED = "ContractUnverified"
    # A frame on the job's control channel refused (`job_agent.wire.Error`).
    BAD_FRAME = "BadFrame"  # not JSON, not an object, a field missing or of the wrong type
    # a kind the receiver does not know, or does not accept from the sender
    UNKNOWN_FRAME = "UnknownFrame"
    REFUSED = "Refused"  # well-formed, but the request cannot be carried out


INCIDENT_ERRORS: tuple[ErrorType, ...] = (
    ErrorType.UNKNOWN_INCIDENT,
    ErrorType.NO_SPARE,
    ErrorType.JOB_GONE,
    ErrorType.OUT_OF_ORDER,
    ErrorType.FREEZE_FAILED,
    ErrorType.TRANSFER_FAILED,
    ErrorType.PROOF_MISMATCH,
    ErrorType.REJOIN_FAILED,
    ErrorType.NO_CHECKPOINT,
    ErrorType.TIMEOUT,
    ErrorType.INVALID_INPUT,
    ErrorType.HANDLED_LOCALLY,
    ErrorType.BEYOND_REDUNDANCY,
)
"""The types an incident's job-side and control-side steps raise."""

RETRYABLE: frozenset[ErrorType] = frozenset(
    {
        # A peer lost or slow mid-stream: the next attempt redoes the step from a clean point.
        ErrorType.TRANSFER_FAILED,
        ErrorType.REJOIN_FAILED,
        ErrorType.TIMEOUT,
        # Billing down or overloaded: the idempotency key makes another attempt safe.
        ErrorType.BILLING_UNAVAILABLE,
    }
)
"""The types another attempt can cure. Every other type is final: retrying it only delays the
fallback."""


def is_retryable(error_type: ErrorType) -> bool:
    return error_type in RETRYABLE


def non_retryable(types: Iterable[ErrorType] = ErrorType) -> tuple[str, ...]:
    """The non-retryable type names among `types`, for a retry policy's
    `non_retryable_error_types`."""
    return tuple(t.value for t in types if t not in RETRYABLE)


class TorchpassError(Exception):
    """Base of torchpass's typed errors: `error_type` names it, `retryable` is decided by the
    vocabulary."""

    error_type: ErrorType = ErrorType.INVALID_INPUT

    def __init__(self, message: str, error_type: ErrorType | None = None) -> None:
        super().__init__(message)
        if error_type is not None:
            self.error_type = error_type

    @property
    def retryable(self) -> bool:
        return is_retryable(self.error_type)
