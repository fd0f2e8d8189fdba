"""The record phase of MigrationWorkflow: an incident the job handled itself, while the control
plane was away, is filed from the job's own record (classified and its proof checked here, like any
other); every outcome is then recorded on the job's contract and by the job. The outcome's figures
are the job's measurements (`torchpass.incident.outcome`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from temporalio import workflow
from temporalio.common import RawValue
from temporalio.exceptions import ApplicationError, FailureError

with workflow.unsafe.imports_passed_through():
    from torchpass.ids import ContractMessage, JobActivity, JobActivityV0, contract_workflow_id
    from torchpass.incident.outcome import (
        CompleteInput,
        Ending,
        MigrationOutcome,
        bounded_error,
        build_outcome,
    )
    from torchpass.incident.proof import filed_ending
    from torchpass.incident.steps import IncidentRef, LocalRecord
    from torchpass.models import ContractRef, Disposition, Evidence, Phase, PhaseTiming
    from workflows.inputs import decode
    from workflows.logs import logger
    from workflows.recovery import Recovery
    from workflows.search_attributes import OUTCOME
    from workflows.step_calls import StepCalls, StepFailed


async def file_local_record(
    recovery: Recovery, ref: IncidentRef, reported: Sequence[Evidence]
) -> MigrationOutcome:
    """File what the job did itself: its record, classified here and its proof checked here, then
    recorded once like any outcome. No record to be had is a failure on the record, with why.

    `reported`: the incident's evidence as it grows (reports folded while the record is fetched
    count)."""
    steps = recovery.steps
    why = ""
    try:
        name = (
            JobActivity.FETCH_LOCAL_RECORD if recovery.renamed else JobActivityV0.RECORDED_OUTCOME
        )
        raw = await steps.call(Phase.RECORD, name, ref, RawValue)
        rec: LocalRecord | None = decode(raw, LocalRecord, f"{name} result")
        if rec is not None and rec.workflow_id != workflow.info().workflow_id:
            raise ApplicationError(f"a record of {rec.workflow_id}, not of this incident")
    except (StepFailed, ApplicationError) as e:
        rec, why = None, f"the job handled this incident itself, but gave no record of it: {e}"
    mine = tuple(ev for ev in rec.evidence if ev.job_id == ref.job_id) if rec else ()
    evidence = mine or tuple(reported)
    confirm = rec.confirm if rec else None
    classification = await recovery.classify(evidence, confirm)
    ending = filed_ending(rec) if rec else Ending(Disposition.FAILED, error=why)
    classified = steps.phases.get(Phase.CLASSIFY)
    phases = (*(rec.phases if rec else ()), *([classified] if classified else []))
    started = rec.started_at if rec else workflow.info().workflow_start_time
    kind = recovery.kind(evidence, classification)
    outcome = build_outcome(
        ref.incident_id, evidence, kind, classification, confirm, ending, started, phases
    )
    return outcome.model_copy(update={"handled_locally": True})


async def record_outcome(
    steps: StepCalls,
    contract: ContractRef | None,
    ref: IncidentRef,
    outcome: MigrationOutcome,
    attest: bool = False,
) -> MigrationOutcome:
    """The contract and the job record the outcome; it stands, with the error, if either cannot.
    Returns it as recorded: the record phase timed into it, and either's error.

    `attest` (the `job-attestation` patch): for a job on a contract, the job signs the outcome's
    facts first, and the contract counts it only with that signature; one the job will not or
    cannot sign is recorded all the same, and the contract keeps it as unconfirmed."""
    steps.phase = Phase.RECORD
    t0 = workflow.now()
    if attest and contract is not None:
        outcome = await _attested(steps, ref, outcome)
    errors = [e for e in (outcome.error, await _record_on_contract(contract, outcome)) if e]
    if errors != [e for e in (outcome.error,) if e]:
        outcome = outcome.model_copy(update={"error": bounded_error("; ".join(errors))})
    stored = await steps.attempt(
        JobActivity.COMPLETE_INCIDENT, CompleteInput(incident=ref, outcome=outcome)
    )
    record = PhaseTiming(phase=Phase.RECORD, seconds=(workflow.now() - t0).total_seconds())
    update: dict[str, Any] = {"phases": (*outcome.phases, record)}
    if stored is not None:
        update["error"] = bounded_error(f"{outcome.error}; {stored}" if outcome.error else stored)
    workflow.upsert_search_attributes([OUTCOME.value_set(outcome.disposition.value)])
    return outcome.model_copy(update=update)


async def _attested(
    steps: StepCalls, ref: IncidentRef, outcome: MigrationOutcome
) -> MigrationOutcome:
    """The outcome with the job's signature, or with why the job gave none in its error."""
    try:
        signature = await steps.call(
            Phase.RECORD,
            JobActivity.ATTEST_OUTCOME,
            CompleteInput(incident=ref, outcome=outcome),
            str,
        )
    except StepFailed as e:
        why = f"not attested by the job (the contract keeps it as unconfirmed): {e}"
        error = f"{outcome.error}; {why}" if outcome.error else why
        return outcome.model_copy(update={"error": bounded_error(error)})
    return outcome.model_copy(update={"attestation": signature})


async def _record_on_contract(c: ContractRef | None, outcome: MigrationOutcome) -> str | None:
    """Signal the job's contract workflow; a contract that is not running is an error kept here."""
    if c is None:
        return None
    contract = workflow.get_external_workflow_handle(
        contract_workflow_id(c.customer_id, c.contract_id)
    )
    try:
        await contract.signal(ContractMessage.RECORD_OUTCOME, outcome)
    except FailureError as e:
        logger.warning("contract %s did not take the outcome: %s", c.contract_id, e)
        return f"not recorded on contract {c.contract_id} of {c.customer_id}: {e}"
    return None
