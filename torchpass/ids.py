"""Names shared by every process: task queues, workflow ids and types, their signals, queries and
updates, activities, search attributes.

One place, so that a worker, a coordinator and the CLI can never disagree on a name: nothing else
types a Temporal name (`tests/unit/test_names.py` fails on a literal one anywhere else).
"""

from __future__ import annotations

CONTROL_TASK_QUEUE = "torchpass-control"
"""Task queue of the control worker: workflows and cluster-wide activities."""


def job_task_queue(job_id: str) -> str:
    """Task queue served by the Temporal worker inside a job's coordinator."""
    return f"torchpass-job-{job_id}"


_UNRESERVED = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-~")


def _part(text: str) -> str:
    """One part of an id, percent-encoded (RFC 3986, as `urllib.parse.quote(text, safe="")`, which
    the workflows may not import): ':' and '/' never survive, so joined parts stay unambiguous
    ('acme-labs' + 'c1' and 'acme' + 'labs-c1' are different ids; an incident id's '/' before the
    run id is always the last one)."""
    return "".join(chr(b) if b in _UNRESERVED else f"%{b:02X}" for b in text.encode("utf-8"))


def incident_workflow_id(job_id: str, failure_domain: str, generation: int) -> str:
    """Workflow id of an incident.

    Keyed by job, failure domain and the job's world generation at detection: every report of the
    same failure (rank exit, dropped connection, a node watch, NVML) folds into one workflow through
    signal-with-start, while a later failure on the same node, after the world re-formed, is a new
    incident.
    """
    return f"torchpass-incident:{_part(job_id)}:{_part(failure_domain)}:g{generation}"


# An incident moved off an id a squatter held goes on at that id + ":x" + this many random hex
# digits.
REKEY_HEX = 16


def contract_workflow_id(customer_id: str, contract_id: str) -> str:
    """Workflow id of a contract: one long-lived ContractWorkflow per customer contract."""
    return f"torchpass-contract:{_part(customer_id)}:{_part(contract_id)}"


def validation_workflow_id(customer_id: str, contract_id: str, job_id: str) -> str:
    """Workflow id of an environment validation run for one job under one customer's contract."""
    return f"torchpass-validate:{_part(customer_id)}:{_part(contract_id)}:{_part(job_id)}"


# Search attributes registered on the server (see workers.server) and set by MigrationWorkflow.
SA_JOB_ID = "TorchpassJobId"
SA_KIND = "TorchpassKind"
SA_OUTCOME = "TorchpassOutcome"
SA_QUALIFYING = "TorchpassQualifying"
SEARCH_ATTRIBUTES = (SA_JOB_ID, SA_KIND, SA_OUTCOME, SA_QUALIFYING)


class WorkflowName:
    """The workflow types, as histories and the Temporal UI show them."""

    MIGRATION = "MigrationWorkflow"  # one incident
    CONTRACT = "ContractWorkflow"  # one customer contract
    VALIDATION = "EnvironmentValidationWorkflow"  # one job's environment checked for a contract


class IncidentMessage:
    """The signal and queries of MigrationWorkflow."""

    REPORT = "report"  # signal: one more report (a FailureReport) of the incident
    STATUS = "status"  # query: its phase, its evidence, the job and task queue it acts for
    OUTCOME = "outcome"  # query: the outcome, once recorded


class ContractMessage:
    """The signal, updates and queries of ContractWorkflow."""

    RECORD_OUTCOME = "record_outcome"  # signal: an incident's outcome, from its MigrationWorkflow
    OPT_IN = "opt_in"  # update
    OPT_OUT = "opt_out"  # update
    RECORD_VALIDATION = "record_validation"  # update: a validation report, from its validation run
    EXPAND = "expand"  # update
    RENEW = "renew"  # update
    STANDING = "standing"  # query
    LEDGER = "ledger"  # query: one page of the ledger


class JobActivity:
    """Names of the activities served on a job's own task queue by its coordinator."""

    CONFIRM_FAILURE = "confirm_failure"
    RESERVE_SPARES = "reserve_spares"  # every lost slot's spare, held for the incident
    RELEASE_SPARE = "release_spare"
    FREEZE_RANKS = "freeze_ranks"
    TRANSFER_STATE = "transfer_state"
    REJOIN = "rejoin"
    RESTART_FROM_CHECKPOINT = "restart_from_checkpoint"
    COMPLETE_INCIDENT = "complete_incident"
    # the job's signature over an outcome's facts, before the contract records it
    ATTEST_OUTCOME = "attest_outcome"
    FETCH_LOCAL_RECORD = "fetch_local_record"  # the record of an incident the job handled itself
    DESCRIBE_JOB = "describe_job"


class JobActivityV0:
    """The names MigrationWorkflow gave two job activities before the `activity-names` patch: its
    recorded histories, and runs started before it, call them, so the job worker serves them too."""

    RESERVE_SPARE = "reserve_spare"  # now RESERVE_SPARES
    # now FETCH_LOCAL_RECORD (it read like the record_outcome signal)
    RECORDED_OUTCOME = "recorded_outcome"


class ControlActivity:
    """Names of the activities served by the control worker."""

    CLASSIFY_FAILURE = "classify_failure"
    DELIVER_CREDIT = "deliver_credit"
    VERIFY_OUTCOMES = "verify_outcomes"
    VERIFY_VALIDATION = "verify_validation"


class ValidationActivity:
    """Names of the validation activities served by the control worker (describe_job is a
    JobActivity)."""

    CHECK_CONTROL_PLANE = "check_control_plane"
    DETECT_SCHEDULER = "detect_scheduler"
    RECORD_VALIDATION = "record_validation_on_contract"
