"""Names shared by every process: task queues, workflow ids, search attributes.

One place, so that a worker, a coordinator and the CLI can never disagree on a name.
"""

from __future__ import annotations

import re

CONTROL_TASK_QUEUE = "torchpass-control"
"""Task queue of the control worker: workflows and cluster-wide activities."""

_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def job_task_queue(job_id: str) -> str:
    """Task queue served by the Temporal worker inside a job's coordinator."""
    return f"torchpass-job-{job_id}"


def incident_workflow_id(job_id: str, failure_domain: str, generation: int) -> str:
    """Workflow id of an incident.

    Keyed by job, failure domain and the job's world generation at detection: every report of the same
    failure (rank exit, dropped connection, a node watch, NVML) folds into one workflow through
    signal-with-start, while a later failure on the same node, after the world re-formed, is a new
    incident.
    """
    domain = _SAFE.sub("_", failure_domain)
    return f"torchpass-incident-{job_id}-{domain}-g{generation}"


def contract_workflow_id(customer_id: str, contract_id: str) -> str:
    """Workflow id of a contract: one long-lived ContractWorkflow per customer contract."""
    return f"torchpass-contract-{_SAFE.sub('_', customer_id)}-{_SAFE.sub('_', contract_id)}"


def validation_workflow_id(contract_id: str, job_id: str) -> str:
    """Workflow id of an environment validation run for one job under one contract."""
    return f"torchpass-validate-{_SAFE.sub('_', contract_id)}-{_SAFE.sub('_', job_id)}"


# Search attributes registered on the server (see torchpass.server) and set by MigrationWorkflow.
SA_JOB_ID = "TorchpassJobId"
SA_KIND = "TorchpassKind"
SA_OUTCOME = "TorchpassOutcome"
SA_QUALIFYING = "TorchpassQualifying"
SEARCH_ATTRIBUTES = (SA_JOB_ID, SA_KIND, SA_OUTCOME, SA_QUALIFYING)


class JobActivity:
    """Names of the activities served on a job's own task queue by its coordinator."""

    CONFIRM_FAILURE = "confirm_failure"
    RESERVE_SPARE = "reserve_spare"
    RELEASE_SPARE = "release_spare"
    FREEZE_RANKS = "freeze_ranks"
    TRANSFER_STATE = "transfer_state"
    REJOIN = "rejoin"
    RESTART_FROM_CHECKPOINT = "restart_from_checkpoint"
    COMPLETE_INCIDENT = "complete_incident"
    DESCRIBE_JOB = "describe_job"


class ControlActivity:
    """Names of the activities served by the control worker."""

    CLASSIFY_FAILURE = "classify_failure"
    DELIVER_CREDIT = "deliver_credit"


class ErrorType:
    """ApplicationError types raised by activities; retry policies list the non-retryable ones."""

    NO_SPARE = "NoSpareAvailable"
    JOB_GONE = "JobGone"
    TRANSFER_FAILED = "TransferFailed"
    REJOIN_FAILED = "RejoinFailed"
    NO_CHECKPOINT = "NoCheckpoint"
    INVALID_INPUT = "InvalidInput"
