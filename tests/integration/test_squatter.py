"""A workflow pre-created at the id of a job's next incident by anyone who can reach Temporal (a
squatter): well-formed, but sending the job's activities to another task queue, it would hold the
job's own report where nothing ever acts on it. The job asks the run that got its report whose
incident it is, sees it is not its own, and moves the incident to a fresh id nobody can guess, where
it is migrated live, and its outcome reaches the contract's ledger once. The real Temporal dev
server, the real control worker, real ranks and a real SIGKILL."""

from __future__ import annotations

import asyncio
import socket
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from temporalio.client import Client, WorkflowExecutionStatus

from bench.chaos import ledger_rows, open_contract
from job_agent import wire
from job_agent.coordinator.jobs import request, wait_until_ready
from tests.integration.conftest import spec, start_job
from tests.integration.test_live_migration import assert_migrated_live
from torchpass.ids import CONTROL_TASK_QUEUE, WorkflowName, incident_workflow_id
from torchpass.models import EventSource, Evidence, FailureKind, FailureReport

ARGS = ("--steps", "300", "--width", "128", "--depth", "2")


@pytest.mark.parametrize(
    ("workflow_type", "queue"),
    [
        (WorkflowName.MIGRATION, CONTROL_TASK_QUEUE),  # answers its query: another job queue
        # answers no query at all (found by an attacker: the record was never filed, and the job
        # blamed Temporal): the server's description of the run unmasks it
        ("SomebodyElsesWorkflow", "torchpass-nobody-polls"),
    ],
)
async def test_an_incident_whose_id_is_squatted_moves_to_a_fresh_id_and_is_migrated_live(
    client: Client, tmp_path: Path, workflow_type: str, queue: str
) -> None:
    name = f"squatted-{'q' if queue == CONTROL_TASK_QUEUE else 'silent'}"
    contract = await open_contract(client, name)
    job = spec(tmp_path, name, args=ARGS, contract=contract)
    task = await start_job(client, job)
    try:
        status = await asyncio.to_thread(
            wait_until_ready, job.state_dir, job.job_id, timedelta(seconds=60)
        )
        agent = next(r.agent for r in status.ranks if r.slot == 2)
        domain = f"{socket.gethostname()}/{agent}"  # what the job will name rank 2's failure domain
        squatted = incident_workflow_id(job.job_id, domain, status.generation)
        forged = Evidence(
            kind=FailureKind.PROCESS_EXIT,
            source=EventSource.COORDINATOR,
            job_id=job.job_id,
            failure_domain=domain,
            slots=(2,),
            detail="a squatter's claim",
            observed_at=datetime.now(UTC),
        )
        start = FailureReport(
            evidence=forged, job_task_queue="torchpass-job-elsewhere", generation=0
        )
        squatter = await client.start_workflow(workflow_type, start, id=squatted, task_queue=queue)
        at = max(r.step for r in status.ranks) + 10
        kill = wire.Inject(action=wire.InjectAction.KILL, slot=2, after_step=at)
        assert isinstance(
            await asyncio.to_thread(request, job.state_dir, job.job_id, kill), wire.Ok
        )
        result = await asyncio.wait_for(asyncio.shield(task), 120)
    finally:
        if not task.done():
            task.cancel()
    reference = await start_job(
        client, spec(tmp_path / "ref", "squatted-reference", spares=0, args=ARGS)
    )
    assert_migrated_live(result, await asyncio.wait_for(reference, 120), 1)
    assert result.incidents_unfiled == 0 and result.reports_undelivered == 0
    (o,) = result.incidents
    moved, _, _ = o.incident_id.partition("/")
    assert moved != squatted and moved.startswith(squatted + ":x"), o.incident_id
    assert o.lost_slots == (2,) and o.kind is FailureKind.PROCESS_EXIT
    # The moved incident reaches the contract's ledger once (checked: a refused claim makes no row).
    (row,) = await ledger_rows(client, contract, result)
    assert row.incident_id == o.incident_id and row.duplicates == 0, row
    # The squatter holds the job's report and acts on nothing; it is left to whoever started it.
    description = await squatter.describe()
    assert description.status is WorkflowExecutionStatus.RUNNING
    await squatter.terminate("test over")
