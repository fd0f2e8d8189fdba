"""The workflows' log lines survive a workflow id holding a `%` (an incident's is percent-encoded:
`torchpass-incident:job:vm%2Frank0-1:g0`): Temporal's own workflow logger appends the run's details
to the format string, and such a line failed to format (lost in production; under pytest, the
workflow task failed with it). On the time-skipping server."""

from __future__ import annotations

import logging
import uuid

import pytest
from temporalio import workflow
from temporalio.api.enums.v1 import EventType
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

with workflow.unsafe.imports_passed_through():
    from workflows.logs import logger


@workflow.defn(name="LogsSomething")
class LogsSomething:
    @workflow.run
    async def run(self, what: str) -> None:
        logger.warning("the step %s failed: %s", what, "100% sure")


async def test_a_line_logged_by_a_workflow_whose_id_holds_a_percent_sign_is_kept(
    env: WorkflowEnvironment, caplog: pytest.LogCaptureFixture
) -> None:
    queue = f"logs-{uuid.uuid4().hex[:8]}"
    wid = f"torchpass-incident:job:vm%2Frank0-1:g0:{queue}"
    with caplog.at_level(logging.WARNING, logger="temporalio.workflow"):
        async with Worker(env.client, task_queue=queue, workflows=[LogsSomething]):
            handle = await env.client.start_workflow(
                "LogsSomething", "transfer", id=wid, task_queue=queue
            )
            await handle.result()
            events = [ev.event_type async for ev in handle.fetch_history_events()]
    assert EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED not in events
    (line,) = [r.getMessage() for r in caplog.records if "the step transfer" in r.getMessage()]
    assert "failed: 100% sure" in line and "vm%2Frank0-1" in line, line
