"""Tracing: an incident, traced end to end on the time-skipping server, and the TORCHPASS_OTEL_*
settings.

The incident runs as in production: the job side signal-with-starts it through
`workers.job.reporter`, the real control worker runs the workflow, and the fake job activities run
on a job worker; every client and worker is built from one client carrying the tracing interceptor,
as `torchpass worker` / `run` build theirs.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pydantic import ValidationError
from temporalio.client import Client
from temporalio.contrib.opentelemetry import TracingInterceptor
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from tests.workflows.fake_job import FakeJob, report
from torchpass.ids import incident_workflow_id
from torchpass.incident.outcome import MigrationOutcome
from torchpass.models import Disposition
from workers.control import control_worker
from workers.job import reporter
from workers.telemetry import TelemetrySettings, interceptors, tracer_provider


@pytest.fixture
def spans() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    # Synchronous export: every span is in the exporter the moment it ends.
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def _traced_client(env: WorkflowEnvironment, provider: TracerProvider) -> Client:
    """env's client (its time-skipping interceptor kept) plus the tracing interceptor."""
    config = env.client.config()
    config["interceptors"] = [*config["interceptors"], *interceptors(TelemetrySettings(), provider)]
    return Client(**config)


async def test_an_incident_is_one_trace_from_report_to_job_activities(
    env: WorkflowEnvironment, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    provider, exporter = spans
    client = _traced_client(env, provider)
    job, rep = FakeJob(), report(f"job-{uuid.uuid4().hex[:8]}")
    workflow_id = incident_workflow_id(
        rep.evidence.job_id, rep.evidence.failure_domain, rep.generation
    )
    async with control_worker(client):
        await reporter(client)(workflow_id, rep)
        async with Worker(client, task_queue=rep.job_task_queue, activities=job.activities()):
            handle = client.get_workflow_handle(workflow_id, result_type=MigrationOutcome)
            outcome = await handle.result()
    assert outcome.disposition == Disposition.MIGRATED

    finished: tuple[ReadableSpan, ...] = exporter.get_finished_spans()
    names = {s.name for s in finished}
    assert {
        "SignalWithStartWorkflow:MigrationWorkflow",  # the job side's report
        "QueryWorkflow:status",  # and its check of the run that got it
        "RunWorkflow:MigrationWorkflow",
        "HandleSignal:report",
        "RunActivity:classify_failure",  # on the control worker
        "StartActivity:confirm_failure",  # scheduled by the workflow
        "RunActivity:confirm_failure",  # run by the job worker
        "RunActivity:complete_incident",
    } <= names, names
    assert len({s.context.trace_id for s in finished if s.context}) == 1
    run = next(s for s in finished if s.name == "RunWorkflow:MigrationWorkflow")
    assert run.attributes and run.attributes["temporalWorkflowID"] == workflow_id


async def test_an_untraced_report_leaves_only_lone_activity_spans(
    env: WorkflowEnvironment, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    """With tracing off in the job agent, the workers trace no workflow (it would be an orphan on
    replay)."""
    provider, exporter = spans
    traced = _traced_client(env, provider)
    job, rep = FakeJob(), report(f"job-{uuid.uuid4().hex[:8]}")
    workflow_id = incident_workflow_id(
        rep.evidence.job_id, rep.evidence.failure_domain, rep.generation
    )
    async with control_worker(traced):
        await reporter(env.client)(workflow_id, rep)
        async with Worker(traced, task_queue=rep.job_task_queue, activities=job.activities()):
            await env.client.get_workflow_handle(workflow_id).result()
    finished = exporter.get_finished_spans()
    assert "RunActivity:confirm_failure" in {s.name for s in finished}
    assert all(s.name.startswith("RunActivity:") and s.parent is None for s in finished), finished


def test_tracing_is_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHPASS_OTEL_EXPORTER", raising=False)
    settings = TelemetrySettings()
    assert settings.exporter == "none" and settings.service_name == "torchpass"
    assert tracer_provider(settings) is None
    assert interceptors(settings) == []


def test_console_exporter_gives_one_tracing_interceptor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHPASS_OTEL_EXPORTER", "console")
    monkeypatch.setenv("TORCHPASS_OTEL_SERVICE_NAME", "torchpass-control")
    settings = TelemetrySettings()
    provider = tracer_provider(settings)
    assert provider is not None
    try:
        assert provider.resource.attributes["service.name"] == "torchpass-control"
        (interceptor,) = interceptors(settings, provider)
        assert isinstance(interceptor, TracingInterceptor)
    finally:
        provider.shutdown()


def test_a_given_provider_turns_tracing_on(
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, _ = spans
    (interceptor,) = interceptors(TelemetrySettings(exporter="none"), provider)
    assert isinstance(interceptor, TracingInterceptor)


def test_an_unknown_exporter_is_refused_with_the_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHPASS_OTEL_EXPORTER", "otlp")
    with pytest.raises(ValidationError) as e:
        TelemetrySettings()
    assert "exporter" in str(e.value) and "'none' or 'console'" in str(e.value)
