"""Client helpers for ContractWorkflow: what the CLI and MigrationWorkflow's wiring call.

Each takes a connected `temporalio.client.Client` (built with the pydantic data converter) and a
contract's customer and contract id. A contract that does not exist raises `UnknownContract`; an
input the contract refuses raises `ContractRejected` with its `error_type` (a `Contract*`
`torchpass.errors.ErrorType` value).
"""

from __future__ import annotations

from collections.abc import Awaitable
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from temporalio.client import Client, WorkflowHandle, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError, WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from torchpass.contract.coverage import JobCoverage
from torchpass.contract.credit import Money
from torchpass.contract.evaluation import Evaluation
from torchpass.contract.queries import LedgerPage, LedgerPageInput, Standing
from torchpass.contract.rules import add_months
from torchpass.contract.state import ContractInput
from torchpass.contract.terms import (
    ContractPurpose,
    ContractTerms,
    ExpandInput,
    OptInInput,
    RenewInput,
)
from torchpass.ids import (
    CONTROL_TASK_QUEUE,
    ContractMessage,
    WorkflowName,
    contract_workflow_id,
    validation_workflow_id,
)
from torchpass.incident.outcome import MigrationOutcome
from torchpass.models import ContractRef
from torchpass.validation.report import ValidateInput, ValidationReport

T = TypeVar("T")
# A query waits for the workflow task in progress; a contract that just took a burst of outcomes (or
# is continuing as new) on a busy worker may need more than the default.
QUERY_TIMEOUT = timedelta(seconds=60)
VALIDATION_TIMEOUT = timedelta(minutes=5)
WORKFLOW = WorkflowName.CONTRACT


class ContractClientError(Exception):
    """Base of the errors these helpers raise."""


class UnknownContract(ContractClientError):
    pass


class ContractExists(ContractClientError):
    pass


class ContractRejected(ContractClientError):
    """The contract refused an input; `error_type` says which rule (a `Contract*` `ErrorType`
    value)."""

    def __init__(self, error_type: str, message: str) -> None:
        super().__init__(f"{error_type}: {message}")
        self.error_type = error_type


def _handle(client: Client, customer_id: str, contract_id: str) -> WorkflowHandle[Any, Any]:
    # No run id: after a continue-as-new the latest run is the contract.
    return client.get_workflow_handle(contract_workflow_id(customer_id, contract_id))


async def _call(what: str, call: Awaitable[T]) -> T:
    try:
        return await call
    except WorkflowUpdateFailedError as e:
        cause = e.cause
        if isinstance(cause, ApplicationError):
            raise ContractRejected(cause.type or "ApplicationError", cause.message) from e
        raise
    except RPCError as e:
        if e.status == RPCStatusCode.NOT_FOUND:
            raise UnknownContract(f"{what}: {e.message}") from e
        raise


async def create_contract(
    client: Client, terms: ContractTerms, task_queue: str = CONTROL_TASK_QUEUE
) -> WorkflowHandle[Any, Any]:
    """Start the contract's workflow; a second create for the same contract raises
    `ContractExists`."""
    try:
        return await client.start_workflow(
            WORKFLOW,
            ContractInput(terms=terms),
            id=contract_workflow_id(terms.customer_id, terms.contract_id),
            task_queue=task_queue,
            result_type=Standing,
        )
    except WorkflowAlreadyStartedError as e:
        raise ContractExists(f"contract {terms.contract_id} of {terms.customer_id} exists") from e


async def open_development_contract(
    client: Client, ref: ContractRef, job_id: str, fee: str
) -> None:
    """A development contract (it accepts a waived scheduler check, and never credits billing)
    starting this month, `fee` USD a year, with `job_id` opted in: what the demo and the chaos
    benchmark run under."""
    start = datetime.now(UTC).date().replace(day=1)
    terms = ContractTerms(
        customer_id=ref.customer_id,
        contract_id=ref.contract_id,
        start=start,
        renewal_date=add_months(start, 12),
        annual_fee=Money(amount=fee, currency="USD"),
        purpose=ContractPurpose.DEVELOPMENT,
    )
    await create_contract(client, terms)
    await opt_in(client, ref.customer_id, ref.contract_id, job_id)


async def opt_in(client: Client, customer_id: str, contract_id: str, job_id: str) -> JobCoverage:
    h = _handle(client, customer_id, contract_id)
    return await _call(
        contract_id,
        h.execute_update(
            ContractMessage.OPT_IN, OptInInput(job_id=job_id), result_type=JobCoverage
        ),
    )


async def opt_out(client: Client, customer_id: str, contract_id: str, job_id: str) -> JobCoverage:
    h = _handle(client, customer_id, contract_id)
    return await _call(
        contract_id,
        h.execute_update(
            ContractMessage.OPT_OUT, OptInInput(job_id=job_id), result_type=JobCoverage
        ),
    )


async def record_validation(
    client: Client, customer_id: str, report: ValidationReport
) -> JobCoverage:
    h = _handle(client, customer_id, report.contract_id)
    return await _call(
        report.contract_id,
        h.execute_update(ContractMessage.RECORD_VALIDATION, report, result_type=JobCoverage),
    )


async def record_outcome(
    client: Client, customer_id: str, contract_id: str, outcome: MigrationOutcome
) -> None:
    """Fire and forget: a duplicate or an uncovered job is recorded as such by the contract."""
    h = _handle(client, customer_id, contract_id)
    await _call(contract_id, h.signal(ContractMessage.RECORD_OUTCOME, outcome))


async def expand(
    client: Client, customer_id: str, contract_id: str, inp: ExpandInput
) -> Evaluation:
    h = _handle(client, customer_id, contract_id)
    return await _call(
        contract_id, h.execute_update(ContractMessage.EXPAND, inp, result_type=Evaluation)
    )


async def renew(client: Client, customer_id: str, contract_id: str, inp: RenewInput) -> Standing:
    h = _handle(client, customer_id, contract_id)
    return await _call(
        contract_id, h.execute_update(ContractMessage.RENEW, inp, result_type=Standing)
    )


async def get_standing(client: Client, customer_id: str, contract_id: str) -> Standing:
    h = _handle(client, customer_id, contract_id)
    return await _call(
        contract_id,
        h.query(ContractMessage.STANDING, result_type=Standing, rpc_timeout=QUERY_TIMEOUT),
    )


async def get_ledger(
    client: Client, customer_id: str, contract_id: str, offset: int = 0, limit: int = 200
) -> LedgerPage:
    h = _handle(client, customer_id, contract_id)
    page = LedgerPageInput(offset=offset, limit=limit)
    return await _call(
        contract_id,
        h.query(ContractMessage.LEDGER, page, result_type=LedgerPage, rpc_timeout=QUERY_TIMEOUT),
    )


async def validate_job(
    client: Client,
    customer_id: str,
    contract_id: str,
    job_id: str,
    job_task_queue: str = "",
    allow_local: bool = False,
) -> ValidationReport:
    """Run EnvironmentValidationWorkflow for one job and wait for its report (recorded on the
    contract).

    Raises temporalio's WorkflowAlreadyStartedError when one is already running for the job.
    """
    inp = ValidateInput(
        customer_id=customer_id,
        contract_id=contract_id,
        job_id=job_id,
        job_task_queue=job_task_queue,
        allow_local=allow_local,
    )
    report: ValidationReport = await client.execute_workflow(
        WorkflowName.VALIDATION,
        inp,
        id=validation_workflow_id(customer_id, contract_id, job_id),
        task_queue=CONTROL_TASK_QUEUE,
        result_type=ValidationReport,
        execution_timeout=VALIDATION_TIMEOUT,
    )
    return report
