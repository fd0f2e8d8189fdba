"""What the contract checks before its ledger counts anything: the claim against the workflow that
made it.

An outcome arrives as a signal anyone with access to Temporal can send, a validation as an update
anyone can run. Neither is counted on its word. The control worker reads the history of the workflow
the claim names (`IncidentFacts`, `ValidationFacts`) and these pure rules judge it:

- an outcome is genuine when its `incident_id` names a `MigrationWorkflow` run that was started for
  the same job and failure domain and itself signalled exactly this outcome to this contract;
- a validation report is genuine when its `source` names an `EnvironmentValidationWorkflow` run, for
  the same contract and job, that itself asked to record exactly this report.

An incident's workflow id is its failure (`torchpass.ids.incident_workflow_id` of job, failure
domain and world generation), checked against its own start input: the contract recognises the same
failure told twice, by two runs of that workflow id, and counts it once.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from pydantic import Field

from torchpass.contract.entries import RejectedClaim
from torchpass.ids import REKEY_HEX, WorkflowName, incident_workflow_id
from torchpass.incident.attestation import attested, endorsed, signed_by, validation_facts
from torchpass.incident.outcome import MAX_INCIDENT_ID, MigrationOutcome
from torchpass.models import FailureReport, Model
from torchpass.validation.report import ValidateInput, ValidationReport

MAX_REASON = 500
MAX_CLAIMS = 50  # outcomes judged by one activity call
# of a claimed workflow's history read before it is judged too long to be genuine
MAX_EVENTS = 10_000
# outcomes awaiting their check; past it a flood is refused, the ledger unharmed
MAX_UNVERIFIED = 1000
MAX_REJECTED_KEPT = 100  # refused claims kept with their reason (every one is counted)


class Verdict(Model):
    """The contract's answer to one claim."""

    claim: str = Field(
        max_length=MAX_INCIDENT_ID + 20, description="the incident id or report source"
    )
    accepted: bool
    reason: str = Field(default="", max_length=MAX_REASON, description="why it was refused")
    failure_key: str | None = Field(
        default=None,
        max_length=1000,
        description="the failure's incident workflow id, once confirmed",
    )
    attested: bool = Field(
        default=True,
        description="an accepted outcome the job signed; False: recorded as unconfirmed, never "
        "counted (True by default: verdicts recorded before attestation existed read as before)",
    )


class OutcomeClaims(Model):
    """Outcomes the contract received, to be checked against their incident workflows."""

    contract_workflow_id: str = Field(min_length=1, max_length=1000)
    outcomes: tuple[MigrationOutcome, ...] = Field(min_length=1, max_length=MAX_CLAIMS)
    keys: dict[str, tuple[str, ...]] = Field(
        default_factory=dict,
        description="job id -> the keys its validations registered on the contract",
    )


class ValidationClaim(Model):
    contract_workflow_id: str = Field(min_length=1, max_length=1000)
    report: ValidationReport
    enrolment_key: str | None = Field(
        default=None, max_length=64, description="the contract's (`ContractTerms.enrolment_key`)"
    )


class Verdicts(Model):
    verdicts: tuple[Verdict, ...]


class IncidentFacts(Model):
    """What an incident workflow's own history says: its type, its start input, what it
    signalled."""

    found: bool
    workflow_type: str = ""
    report: FailureReport | None = Field(
        default=None, description="its start input, when it decodes"
    )
    signalled: tuple[MigrationOutcome, ...] = Field(
        default=(),
        description="the record_outcome signals it sent to the claiming contract, decoded",
    )
    detail: str = Field(default="", max_length=MAX_REASON)


class ValidationFacts(Model):
    found: bool
    workflow_type: str = ""
    task_queue: str = Field(default="", description="the queue its workflow tasks ran on")
    request: ValidateInput | None = None
    recorded: tuple[ValidationReport, ...] = Field(
        default=(),
        description="the reports it asked to record, decoded from its own activity inputs",
    )
    detail: str = Field(default="", max_length=MAX_REASON)


def split_run(claim: str) -> tuple[str, str | None]:
    """`workflow-id/run-id` (an incident id) into its parts; a bare workflow id has no run."""
    wf, sep, run = claim.rpartition("/")
    if not sep or not wf or len(run) != 36:  # run ids are UUIDs; anything else is part of the id
        return claim, None
    return wf, run


def failure_key(report: FailureReport) -> str:
    ev = report.evidence
    return incident_workflow_id(ev.job_id, ev.failure_domain, report.generation)


def at_key(workflow_id: str, key: str) -> bool:
    """Whether an incident workflow's id is its failure's key, or the fresh id the job moved it to
    when a squatter held that one (the key, ':x' and 16 hex digits:
    `job_agent.coordinator.incident.tracker.IncidentTracker.rekey`). Both count under the key, so
    the squatted and the moved incident are one failure in the ledger."""
    if workflow_id == key:
        return True
    head, sep, tail = workflow_id.rpartition(":x")
    return (
        bool(sep)
        and head == key
        and len(tail) == REKEY_HEX
        and all(c in "0123456789abcdef" for c in tail)
    )


def _refused(claim: str, why: str) -> Verdict:
    return Verdict(claim=claim[: MAX_INCIDENT_ID + 20], accepted=False, reason=why[:MAX_REASON])


def judge_outcome(
    outcome: MigrationOutcome, facts: IncidentFacts, keys: Iterable[str] = ()
) -> Verdict:
    """Genuine when its incident workflow bears it out (else refused); attested when one of the
    job's registered `keys` signed its facts (else recorded as unconfirmed)."""
    claim = outcome.incident_id
    if split_run(claim)[1] is None:
        return _refused(claim, "the incident id names no workflow run")
    if not facts.found:
        return _refused(claim, f"no such incident workflow: {facts.detail}")
    if facts.workflow_type != WorkflowName.MIGRATION:
        return _refused(claim, f"not an incident: the workflow is a {facts.workflow_type!r}")
    if facts.report is None:
        return _refused(
            claim, f"the incident's start input is not a failure report: {facts.detail}"
        )
    ev = facts.report.evidence
    if (ev.job_id, ev.failure_domain) != (outcome.job_id, outcome.failure_domain):
        return _refused(
            claim,
            f"the incident was started for job {ev.job_id!r} on {ev.failure_domain!r}, the outcome "
            f"claims {outcome.job_id!r} on {outcome.failure_domain!r}",
        )
    key = failure_key(facts.report)
    if not at_key(split_run(claim)[0], key):
        return _refused(claim, f"not at its failure's incident id {key!r}")
    if outcome not in facts.signalled:
        why = "sent no outcome" if not facts.signalled else "sent another outcome"
        return _refused(claim, f"the incident workflow {why} to this contract")
    signed = attested(outcome, keys)
    why = "" if signed else unattested(outcome, keys)
    return Verdict(claim=claim, accepted=True, failure_key=key, attested=signed, reason=why)


def unattested(outcome: MigrationOutcome, keys: Iterable[str]) -> str:
    if not tuple(keys):
        return "no key of the job is registered on the contract (no validation carried one)"
    if outcome.attestation is None:
        return "the job never attested it"
    return "its attestation is not the job's signature over these facts"


def judge_validation(
    report: ValidationReport,
    facts: ValidationFacts,
    control_queue: str,
    enrolment_key: str | None = None,
) -> Verdict:
    """Genuine when a validation workflow that ran on the control worker's own queue
    (`control_queue`) made this report for this contract and job, and the job proved it holds the
    key the report registers; on a contract with an `enrolment_key`, that key vouched for the
    job's."""
    claim = report.source or ""
    if not claim or split_run(claim)[1] is None:
        return _refused(claim or "(none)", "the report names no validation workflow run")
    if not facts.found:
        return _refused(claim, f"no such validation workflow: {facts.detail}")
    if facts.workflow_type != WorkflowName.VALIDATION:
        return _refused(claim, f"not a validation: the workflow is a {facts.workflow_type!r}")
    req = facts.request
    if req is None or (req.contract_id, req.job_id) != (report.contract_id, report.job_id):
        return _refused(claim, "the validation workflow was started for another contract or job")
    if facts.task_queue != control_queue:
        return _refused(
            claim,
            f"the validation ran on task queue {facts.task_queue!r}, not on the control worker's "
            f"{control_queue!r}",
        )
    if report not in facts.recorded:
        return _refused(claim, "the validation workflow did not make this report")
    if report.job_key is None or not signed_by(
        report.job_key, validation_facts(report.job_id, claim, report.job_key), report.job_proof
    ):
        return _refused(claim, "the job did not prove it holds the key the report names")
    if enrolment_key is not None and not endorsed(
        enrolment_key, report.job_id, report.job_key, report.job_endorsement
    ):
        return _refused(
            claim,
            "the job's key is not vouched for by the contract's enrolment key (a job not started "
            "on the customer's cluster)",
        )
    return Verdict(claim=claim, accepted=True)


class Quarantine:
    """A contract's claims not counted: the outcomes awaiting their check, and the refused (the
    latest, with why, apart from the ledger: they never count, nor block the genuine outcome of
    their incident id arriving later). Part of `ContractBook`, carried across continue-as-new in its
    state."""

    def __init__(
        self,
        unverified: Iterable[MigrationOutcome] = (),
        rejected: Iterable[RejectedClaim] = (),
        rejected_claims: int = 0,
    ) -> None:
        self.unverified = list(unverified)
        self.rejected = list(rejected)
        self.rejected_claims = rejected_claims

    def hold(self, outcome: MigrationOutcome) -> bool:
        if len(self.unverified) >= MAX_UNVERIFIED:
            self.reject(
                outcome.incident_id,
                outcome.job_id,
                outcome.detected_at,
                "too many awaiting a check",
            )
            return False
        self.unverified.append(outcome)
        return True

    def reject(self, claim: str, job_id: str, at: datetime, reason: str) -> RejectedClaim:
        entry = RejectedClaim(claim=claim, job_id=job_id, at=at, reason=reason[:MAX_REASON])
        self.rejected = [*self.rejected[-(MAX_REJECTED_KEPT - 1) :], entry]
        self.rejected_claims += 1
        return entry
