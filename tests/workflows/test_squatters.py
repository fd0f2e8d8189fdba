"""The job's reporter (`workers.job.reporter`) against squatters that answer no query: a workflow of
another type at the incident's id, and a MigrationWorkflow on a queue no control worker polls. The
server's own description of the run (no worker needed) unmasks both at once, so the job moves the
incident to a fresh id (`Squatted`) instead of leaving its report where nothing acts on it, and the
genuine run, answering or not, is left alone."""

from __future__ import annotations

import uuid

import pytest
from temporalio.testing import WorkflowEnvironment

from job_agent.coordinator.incident.tracker import Squatted
from tests.workflows.fake_job import control_worker, report
from torchpass.ids import CONTROL_TASK_QUEUE, WorkflowName, incident_workflow_id
from workers.job import reporter


@pytest.mark.parametrize(
    ("workflow_type", "queue"),
    [("SomebodyElsesWorkflow", "unpolled"), (WorkflowName.MIGRATION, "unpolled")],
)
async def test_a_squatter_that_answers_no_query_is_unmasked_by_the_servers_description(
    env: WorkflowEnvironment, workflow_type: str, queue: str
) -> None:
    rep = report(f"job-{uuid.uuid4().hex[:8]}")
    workflow_id = incident_workflow_id(rep.evidence.job_id, rep.evidence.failure_domain, 0)
    squatter = await env.client.start_workflow(
        workflow_type, rep, id=workflow_id, task_queue=f"{queue}-{uuid.uuid4().hex[:6]}"
    )
    with pytest.raises(Squatted, match="no torchpass control worker runs it"):
        await reporter(env.client)(workflow_id, rep)
    await squatter.terminate("test over")


async def test_the_genuine_run_is_left_alone_answering_or_not(env: WorkflowEnvironment) -> None:
    """With the control worker away the genuine run answers no query either: proving nothing, it is
    not moved (the job's own recovery covers the gap)."""
    for served in (False, True):
        rep = report(f"job-{uuid.uuid4().hex[:8]}")
        workflow_id = incident_workflow_id(rep.evidence.job_id, rep.evidence.failure_domain, 0)
        if served:
            async with control_worker(env):
                await reporter(env.client)(workflow_id, rep)
        else:
            await reporter(env.client)(workflow_id, rep)
        handle = env.client.get_workflow_handle(workflow_id)
        desc = await handle.describe()
        assert (desc.workflow_type, desc.task_queue) == (WorkflowName.MIGRATION, CONTROL_TASK_QUEUE)
        await handle.terminate("test over")
