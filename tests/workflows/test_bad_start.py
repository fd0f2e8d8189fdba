"""A workflow started with a malformed input fails at once with a typed error naming the field; it
never fails its workflow task over and over (which leaves it open, holding its id, answering
nothing). The real workflows on the time-skipping server."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from torchpass.ids import WorkflowName
from workflows.contract import CONTRACT_WORKFLOWS
from workflows.migration import MigrationWorkflow
from workflows.validation import VALIDATION_WORKFLOWS

BAD = [{"garbage": 1}, {"evidence": {"kind": "not-a-kind"}}, 42, "a string", None, {"terms": {}}]


@pytest.mark.parametrize(
    "workflow", [WorkflowName.MIGRATION, WorkflowName.CONTRACT, WorkflowName.VALIDATION]
)
@pytest.mark.parametrize("start", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
async def test_a_malformed_start_input_fails_the_workflow_not_its_task(
    env: WorkflowEnvironment, workflow: str, start: Any
) -> None:
    queue = f"bad-start-{uuid.uuid4().hex[:8]}"
    workflows = [MigrationWorkflow, *CONTRACT_WORKFLOWS, *VALIDATION_WORKFLOWS]
    async with Worker(env.client, task_queue=queue, workflows=workflows):
        handle = await env.client.start_workflow(workflow, start, id=queue, task_queue=queue)
        with pytest.raises(WorkflowFailureError) as e:  # a task failing over and over never ends
            await asyncio.wait_for(handle.result(), timeout=30)
        events = [ev.event_type async for ev in handle.fetch_history_events()]
    cause = e.value.cause
    assert (
        isinstance(cause, ApplicationError) and cause.type == "InvalidInput" and cause.non_retryable
    )
    assert "malformed start input" in cause.message
    assert EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED not in events
