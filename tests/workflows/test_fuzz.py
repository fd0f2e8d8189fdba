"""Malformed input never sticks a workflow: generated start inputs, signals and updates, at least
500 to each workflow, and afterwards no workflow task has failed and none is left stuck. Inputs are
random JSON values and mutations of valid payloads (a field dropped, retyped, blown up, an unknown
one added), each checked to be invalid for its model before it is sent. Seeded: a failure names the
seed that reproduces it. The real workflows on the time-skipping server; the job side is FakeJob."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Awaitable, Iterator
from datetime import UTC, date, datetime
from typing import Any

from pydantic import BaseModel, ValidationError
from temporalio.api.enums.v1 import EventType
from temporalio.client import (
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowHandle,
    WorkflowUpdateFailedError,
)
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from tests.workflows.fake_job import FakeJob, control_worker, report, signal_with_start
from tests.workflows.test_contract import TRUSTING
from tests.workflows.test_validation_workflow import outcome as valid_outcome
from torchpass.contract.credit import Money
from torchpass.contract.queries import Standing
from torchpass.contract.rules import add_months
from torchpass.contract.state import ContractInput
from torchpass.contract.terms import ContractTerms, ExpandInput, OptInInput, RenewInput
from torchpass.errors import ErrorType
from torchpass.ids import CONTROL_TASK_QUEUE, ContractMessage, IncidentMessage, WorkflowName
from torchpass.incident.outcome import MigrationOutcome
from torchpass.models import FailureReport
from torchpass.validation.report import CheckResult, ValidateInput, ValidationReport
from workflows.contract import CONTRACT_WORKFLOWS
from workflows.validation import VALIDATION_WORKFLOWS

SEED = 20261203
NOW = datetime(2026, 12, 1, tzinfo=UTC)


def _value(rng: random.Random, depth: int = 0) -> Any:
    """A random JSON value."""
    kinds = ["null", "bool", "int", "float", "str", "long"] + (
        ["list", "dict"] if depth < 3 else []
    )
    k = rng.choice(kinds)
    if k == "null":
        return None
    if k == "bool":
        return rng.random() < 0.5
    if k == "int":
        return rng.choice([0, -1, 1, 2**63, -(2**70), rng.randint(-1000, 1000)])
    if k == "float":
        return rng.choice([0.5, -1e308, 1e308, rng.uniform(-1e6, 1e6)])
    if k == "str":
        odd = ["", "x", "2026-13-45", "1e30", "null", "\u0000", "ünïcødé", "USD", "-5"]
        return rng.choice(odd)
    if k == "long":
        return "y" * rng.choice([201, 1001, 5000])
    if k == "list":
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(["a", "job_id", "kind", "", "on"]): _value(rng, depth + 1) for _ in range(3)}


def _mutate(rng: random.Random, valid: dict[str, Any]) -> Any:
    """A valid payload with one thing wrong, or a random value instead."""
    if rng.random() < 0.2 or not valid:
        return _value(rng)
    data = dict(valid)
    key = rng.choice(sorted(data))
    how = rng.choice(["drop", "retype", "unknown", "nest"])
    if how == "drop":
        del data[key]
    elif how == "retype":
        data[key] = _value(rng)
    elif how == "unknown":
        data[f"not_{key}"] = _value(rng)
    elif isinstance(data[key], dict):
        data[key] = _mutate(rng, data[key])
    else:
        data[key] = [data[key]]
    return data


def malformed(
    rng: random.Random, model: type[BaseModel], valid: BaseModel, n: int
) -> Iterator[Any]:
    """`n` payloads that are not `model` (checked: a mutation that happens to stay valid is
    skipped)."""
    template = valid.model_dump(mode="json")
    made = 0
    while made < n:
        candidate = _mutate(rng, template)
        try:
            model.model_validate(candidate)
        except (ValidationError, TypeError, ValueError):
            made += 1
            yield candidate


async def _task_failures(handle: WorkflowHandle[Any, Any]) -> int:
    failed = EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED
    return len([ev async for ev in handle.fetch_history_events() if ev.event_type == failed])


async def _gather(calls: list[Awaitable[Any]], width: int = 25) -> list[Any]:
    out: list[Any] = []
    for i in range(0, len(calls), width):
        out += await asyncio.gather(*calls[i : i + width], return_exceptions=True)
    return out


async def _bad_starts(
    env: WorkflowEnvironment, workflow: str, queue: str, inputs: list[Any]
) -> int:
    """Start one workflow per input; each must fail at once, typed, without a failed workflow
    task."""

    async def one(inp: Any) -> int:
        handle = await env.client.start_workflow(
            workflow, inp, id=f"fuzz-{uuid.uuid4()}", task_queue=queue
        )
        try:
            await asyncio.wait_for(handle.result(), 30)
        except WorkflowFailureError as e:
            cause = e.cause
            assert isinstance(cause, ApplicationError) and cause.type == ErrorType.INVALID_INPUT, (
                inp,
                e,
            )
        else:
            raise AssertionError(f"{workflow} ran with {inp!r}")
        return await _task_failures(handle)

    results = await _gather([one(i) for i in inputs])
    errors = [(i, r) for i, r in zip(inputs, results, strict=True) if isinstance(r, BaseException)]
    assert not errors, "\n".join(f"{i!r}: {r!r}"[:1500] for i, r in errors[:3])
    return sum(r for r in results if isinstance(r, int))


async def test_generated_malformed_inputs_never_fail_a_task_or_stick_a_workflow(
    env: WorkflowEnvironment,
) -> None:
    rng = random.Random(SEED)
    today = (await env.get_current_time()).date()
    terms = ContractTerms(
        customer_id="fuzz",
        contract_id=f"c-{uuid.uuid4().hex[:8]}",
        start=today,
        renewal_date=add_months(today, 12),
        annual_fee=Money(amount="1000", currency="USD"),
    )
    rep = report(f"job-{uuid.uuid4().hex[:8]}", at=NOW)
    check = CheckResult(name="torch_backend", passed=True)
    vreport = ValidationReport(
        contract_id="c", job_id="j", passed=True, checks=(check,), validated_at=NOW
    )
    expand = ExpandInput(on=date(2027, 1, 1), annual_fee=Money(amount="2000", currency="USD"))
    sent = {WorkflowName.MIGRATION: 0, WorkflowName.CONTRACT: 0, WorkflowName.VALIDATION: 0}
    async with control_worker(env):
        done, failed = await _fuzz_incident(env, rng, rep)
    # every malformed report dropped, the incident done
    assert failed == 0 and done.evidence_count == 1
    sent[WorkflowName.MIGRATION] += 250
    # No timer is needed below: skipping time while hundreds of starts queue up would skip straight
    # to the server's default execution timeout of the ones not yet picked up.
    with env.auto_time_skipping_disabled():
        await _fuzz(env, rng, terms, rep, vreport, expand, sent)
    assert all(n >= 500 for n in sent.values()), sent


async def _fuzz_incident(
    env: WorkflowEnvironment, rng: random.Random, rep: FailureReport
) -> tuple[MigrationOutcome, int]:
    failed_tasks = 0
    # Signals to an incident waiting on its job (no job worker yet, well within confirm's bounds),
    # then the job answers.
    incident = await signal_with_start(env, rep)
    await _gather(
        [
            incident.signal(IncidentMessage.REPORT, s)
            for s in malformed(rng, FailureReport, rep, 250)
        ]
    )
    async with Worker(env.client, task_queue=rep.job_task_queue, activities=FakeJob().activities()):
        done = await asyncio.wait_for(incident.result(), 60)
    return done, failed_tasks + await _task_failures(incident)


async def _fuzz(
    env: WorkflowEnvironment,
    rng: random.Random,
    terms: ContractTerms,
    rep: FailureReport,
    vreport: ValidationReport,
    expand: ExpandInput,
    sent: dict[str, int],
) -> None:
    failed_tasks = 0
    async with (
        control_worker(env),
        Worker(
            env.client,
            task_queue="fuzz-contracts",
            workflows=[*CONTRACT_WORKFLOWS, *VALIDATION_WORKFLOWS],
            activities=TRUSTING,
        ),
    ):
        # Start inputs.
        for workflow, model, valid, queue, n in (
            (WorkflowName.MIGRATION, FailureReport, rep, CONTROL_TASK_QUEUE, 250),
            (
                WorkflowName.CONTRACT,
                ContractInput,
                ContractInput(terms=terms),
                "fuzz-contracts",
                150,
            ),
            (
                WorkflowName.VALIDATION,
                ValidateInput,
                ValidateInput(contract_id="c", customer_id="a", job_id="j"),
                "fuzz-contracts",
                500,
            ),
        ):
            inputs = list(malformed(rng, model, valid, n))
            failed_tasks += await _bad_starts(env, workflow, queue, inputs)
            sent[workflow] += n

        # Signals and updates to a running contract.
        contract = await env.client.start_workflow(
            WorkflowName.CONTRACT,
            ContractInput(terms=terms),
            id=f"fuzz-contract-{uuid.uuid4()}",
            task_queue="fuzz-contracts",
        )
        outcome = valid_outcome(NOW)
        await _gather(
            [
                contract.signal(ContractMessage.RECORD_OUTCOME, s)
                for s in malformed(rng, MigrationOutcome, outcome, 200)
            ]
        )
        updates = [
            (name, arg)
            for name, model, valid, n in (
                ("opt_in", OptInInput, OptInInput(job_id="j"), 50),
                ("opt_out", OptInInput, OptInInput(job_id="j"), 25),
                ("record_validation", ValidationReport, vreport, 50),
                ("expand", ExpandInput, expand, 50),
                ("renew", RenewInput, RenewInput(next_renewal=date(2028, 1, 1)), 25),
            )
            for arg in malformed(rng, model, valid, n)
        ]
        answers = await _gather(
            [contract.execute_update(name, arg) for name, arg in updates], width=10
        )
        sent[WorkflowName.CONTRACT] += 200 + len(updates)
        refused = [a for a in answers if isinstance(a, WorkflowUpdateFailedError)]
        assert len(refused) == len(updates), [
            a for a in answers if not isinstance(a, WorkflowUpdateFailedError)
        ][:3]
        for a in refused:
            assert (
                isinstance(a.cause, ApplicationError) and a.cause.type == ErrorType.INVALID_INPUT
            ), a.cause

        # still answering
        standing = await contract.query(ContractMessage.STANDING, result_type=Standing)
        desc = await contract.describe()
        failed_tasks += await _task_failures(contract)
        await contract.terminate("test done")
    assert failed_tasks == 0
    assert desc.status is WorkflowExecutionStatus.RUNNING and standing.rejected_signals == 200
