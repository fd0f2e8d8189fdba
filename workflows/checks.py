"""The contract's checks of what it is told (`torchpass.contract.verify`), as workflow steps: one
activity each, run on the control worker, which reads the claimed workflow's history."""

from __future__ import annotations

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from torchpass.contract.book import ContractBook
    from torchpass.contract.verify import (
        MAX_CLAIMS,
        OutcomeClaims,
        ValidationClaim,
        Verdict,
        Verdicts,
    )
    from torchpass.errors import ErrorType
    from torchpass.ids import ControlActivity
    from torchpass.policies import VERIFY_AGAIN_AFTER, VERIFY_RETRY, VERIFY_TIMEOUTS
    from torchpass.validation.report import ValidationReport
    from workflows.logs import logger
    from workflows.policy import retry_policy


async def check_outcomes(book: ContractBook, contract_workflow_id: str) -> bool:
    """Check the oldest queued outcomes against their incidents: the genuine are counted, the rest
    kept as rejected with why. False when the check could not run: then they stay queued."""
    batch = tuple(book.checks.unverified[:MAX_CLAIMS])
    keys = {o.job_id: book.jobs.keys(o.job_id) for o in batch}
    claims = OutcomeClaims(contract_workflow_id=contract_workflow_id, outcomes=batch, keys=keys)
    t = VERIFY_TIMEOUTS[ControlActivity.VERIFY_OUTCOMES]
    try:
        result = await workflow.execute_activity(
            ControlActivity.VERIFY_OUTCOMES,
            claims,
            result_type=Verdicts,
            start_to_close_timeout=t.start_to_close,
            heartbeat_timeout=t.heartbeat,
            schedule_to_close_timeout=t.schedule_to_close,
            retry_policy=retry_policy(VERIFY_RETRY),
        )
        verdicts = result.verdicts
        if [v.claim for v in verdicts] != [o.incident_id for o in batch]:
            raise ValueError("the verdicts do not answer the claims")
    except (ActivityError, ValueError) as e:
        logger.error("outcomes not checked, again in %s: %s", VERIFY_AGAIN_AFTER, e)
        return False
    del book.checks.unverified[: len(batch)]  # those that arrived meanwhile wait behind
    for outcome, verdict in zip(batch, verdicts, strict=True):
        if verdict.accepted and not verdict.attested:
            logger.warning("outcome %s unconfirmed: %s", outcome.incident_id, verdict.reason)
        if verdict.accepted and verdict.failure_key:
            book.record_checked(outcome, verdict.failure_key, verdict.attested)
        elif verdict.accepted:
            book.record_outcome(outcome, verdict.attested)
        else:
            logger.warning("outcome %s rejected: %s", outcome.incident_id, verdict.reason)
            book.checks.reject(
                outcome.incident_id, outcome.job_id, outcome.detected_at, verdict.reason
            )
    return True


async def check_validation(
    report: ValidationReport, contract_workflow_id: str, enrolment_key: str | None = None
) -> Verdict:
    """The verdict on a report; a check that cannot run is a retryable error to the update's
    caller."""
    t = VERIFY_TIMEOUTS[ControlActivity.VERIFY_VALIDATION]
    claim = ValidationClaim(
        contract_workflow_id=contract_workflow_id, report=report, enrolment_key=enrolment_key
    )
    try:
        return await workflow.execute_activity(
            ControlActivity.VERIFY_VALIDATION,
            claim,
            result_type=Verdict,
            start_to_close_timeout=t.start_to_close,
            schedule_to_close_timeout=t.schedule_to_close,
            retry_policy=retry_policy(VERIFY_RETRY),
        )
    except ActivityError as e:
        raise ApplicationError(
            f"validation could not be checked now: {e.cause or e}"[:2000],
            type=ErrorType.CONTRACT_UNVERIFIED.value,
        ) from e
