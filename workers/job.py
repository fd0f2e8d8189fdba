"""The job worker: a coordinator plus the Temporal worker that serves its incidents' job-side
activities.

`torchpass run` runs this in the foreground; the ranks and spares are its children.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

from temporalio.client import Client
from temporalio.contrib.opentelemetry import TracingInterceptor
from temporalio.worker import Worker

from activities.job import JobActivities
from job_agent.coordinator.coordinator import Coordinator
from job_agent.coordinator.incident.executor import IncidentSteps
from job_agent.coordinator.incident.local import LocalRecovery
from job_agent.coordinator.incident.tracker import Squatted
from job_agent.coordinator.jobs import job_key
from torchpass.ids import CONTROL_TASK_QUEUE, IncidentMessage, WorkflowName, job_task_queue
from torchpass.incident.attestation import JobKey
from torchpass.incident.outcome import IncidentStatus
from torchpass.job import JobResult, JobSpec
from torchpass.models import FailureReport
from torchpass.policies import INCIDENT_TASK_TIMEOUT
from workers.temporal import owner_only

log = logging.getLogger("torchpass.coordinator")
QUERY_TIMEOUT = timedelta(seconds=5)


def reporter(client: Client) -> Callable[[str, FailureReport], Awaitable[None]]:
    """Signal-with-start: the first report of a failure starts its incident, later ones fold into
    it; a late one (after the outcome) is only signalled to the run that recorded it."""

    async def report(workflow_id: str, rep: FailureReport) -> None:
        with _span(client, f"ReportIncident:{workflow_id}"):
            await _report(client, workflow_id, rep)

    return report


def _span(client: Client, name: str) -> contextlib.AbstractContextManager[object]:
    """One span over a report and its check when the client traces, so both sit in the incident's
    trace."""
    tracing = [i for i in client.config()["interceptors"] if isinstance(i, TracingInterceptor)]
    return tracing[0].tracer.start_as_current_span(name) if tracing else contextlib.nullcontext()


async def _report(client: Client, workflow_id: str, rep: FailureReport) -> None:
    # to the run that recorded the outcome, open for the late window: never a new incident
    if rep.late:
        wf, _, run = workflow_id.partition("/")
        await client.get_workflow_handle(wf, run_id=run or None).signal(IncidentMessage.REPORT, rep)
        return
    handle = await client.start_workflow(
        WorkflowName.MIGRATION,
        rep,
        id=workflow_id,
        task_queue=CONTROL_TASK_QUEUE,
        task_timeout=INCIDENT_TASK_TIMEOUT,
        start_signal=IncidentMessage.REPORT,
        start_signal_args=[rep],
    )
    # The run that got it may be somebody else's, started at the id first: one that sends the job's
    # activities elsewhere, or is another job's, would swallow the report. What the server says of
    # it (no worker needed) comes first: a run of another type, or on a queue no control worker
    # polls, answers no query ever and is a squatter. Then its own answer: one that says so moves
    # the incident (`Squatted`); no answer (the control worker is away) proves nothing.
    desc = await handle.describe(rpc_timeout=QUERY_TIMEOUT)
    if desc.workflow_type != WorkflowName.MIGRATION or desc.task_queue != CONTROL_TASK_QUEUE:
        raise Squatted(
            f"the run at {workflow_id} is a {desc.workflow_type!r} on task queue "
            f"{desc.task_queue!r}: no torchpass control worker runs it"
        )
    try:
        status = await handle.query(
            IncidentMessage.STATUS, result_type=IncidentStatus, rpc_timeout=QUERY_TIMEOUT
        )
    except Exception as e:
        log.info("incident %s: no status answer to check it by (%s)", workflow_id, e)
        return
    job_id, queue = rep.evidence.job_id, rep.job_task_queue
    if rep.opens and status.disposition is not None:
        # A run of the same id that recorded its outcome and waits only for late evidence: an
        # earlier incident of a job of the same id (run again within the late window), never this
        # new one.
        raise Squatted(f"the run at {workflow_id} has recorded its own incident's outcome already")
    if status.job_id and (status.job_id, status.job_task_queue) != (job_id, queue):
        raise Squatted(
            f"the run at {workflow_id} is an incident of job {status.job_id!r} with its activities "
            f"on {status.job_task_queue!r}, not of job {job_id!r} on {queue!r}"
        )


def enrolment_key(path: Path) -> JobKey:
    """The cluster's enrolment key from its file: its owner's alone and an Ed25519 key, else a
    ValueError naming the file and the fix."""
    owner_only("enrolment key file", path)
    try:
        return JobKey.from_hex(path.read_text())
    except ValueError as e:
        raise ValueError(
            f"enrolment key file {path}: not an Ed25519 private key in hex ({e}); make one with "
            "`torchpass contract enrolment-key --out FILE`"
        ) from None


def endorsement(spec: JobSpec, key: JobKey) -> str | None:
    """The enrolment key's word for this job's key, where the job was given one."""
    if spec.enrolment_key_file is None:
        return None
    return enrolment_key(spec.enrolment_key_file).endorse(spec.job_id, key.public)


async def run_job(spec: JobSpec, client: Client) -> JobResult:
    coordinator = Coordinator(spec, reporter(client))
    steps = IncidentSteps(coordinator)
    LocalRecovery(steps)  # the job goes on by itself when no workflow step comes
    key = job_key(spec.job_dir)
    acts = JobActivities(coordinator, steps, key, endorsement(spec, key))
    worker = Worker(
        client, task_queue=job_task_queue(spec.job_id), activities=list(_activity_methods(acts))
    )
    async with worker:
        result = await coordinator.run()
        # Let an incident still recording finish before the worker goes.
        await asyncio.sleep(0)
    return result


def _activity_methods(acts: JobActivities) -> Iterator[Callable[..., Any]]:
    for name in dir(acts):
        fn = getattr(acts, name)
        if hasattr(fn, "__temporal_activity_definition"):
            yield fn
