"""OpenTelemetry tracing of incidents, off unless an SRE turns it on (TORCHPASS_OTEL_* variables).

With tracing on, every Temporal client built by `workers.temporal.connect` carries a
`TracingInterceptor`, and so do the workers built from that client: a signal-with-start of an
incident, its `RunWorkflow` span, the activities it schedules and their `RunActivity` spans on the
job worker share one trace.

The only exporter built in is "console" (spans printed to stdout as JSON), because torchpass
installs no exporter package. Any OpenTelemetry SDK exporter (OTLP, Jaeger, a vendor's) can be
plugged in by building a `TracerProvider` with it and passing that provider to
`interceptors(settings, provider)`.
"""

from __future__ import annotations

from typing import Literal

from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict
from temporalio.contrib.opentelemetry import TracingInterceptor

TRACER_NAME = "torchpass"


class TelemetrySettings(BaseSettings):
    """TORCHPASS_OTEL_* variables; validated once at start-up."""

    model_config = SettingsConfigDict(env_prefix="TORCHPASS_OTEL_", extra="ignore")

    exporter: Literal["none", "console"] = Field(
        default="none", description="where spans go: 'none' (tracing off) or 'console' (stdout)"
    )
    service_name: str = Field(
        default="torchpass", description="the service.name resource of every span"
    )


def tracer_provider(settings: TelemetrySettings) -> TracerProvider | None:
    """An SDK provider exporting as `settings.exporter` says, or None when tracing is off."""
    if settings.exporter == "none":
        return None
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: settings.service_name}))
    # Batched: exporting never blocks a workflow task or an activity.
    provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    return provider


def interceptors(
    settings: TelemetrySettings, provider: TracerProvider | None = None
) -> list[TracingInterceptor]:
    """Client (and worker) interceptors: one `TracingInterceptor` when tracing is on, none when off.

    A given `provider` wins over the one `settings.exporter` would build, so a caller can plug any
    exporter.
    """
    provider = provider or tracer_provider(settings)
    if provider is None:
        return []
    return [TracingInterceptor(provider.get_tracer(TRACER_NAME))]
