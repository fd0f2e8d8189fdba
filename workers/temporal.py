"""One way to connect to Temporal, shared by every process and the CLI."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict
from temporalio.client import Client, Interceptor, TLSConfig
from temporalio.contrib.pydantic import pydantic_data_converter


class TemporalSettings(BaseSettings):
    """TORCHPASS_TEMPORAL_* variables or CLI flags; validated once at start-up."""

    model_config = SettingsConfigDict(env_prefix="TORCHPASS_TEMPORAL_", extra="ignore")

    address: str = "127.0.0.1:7233"
    namespace: str = "default"
    api_key: str | None = Field(default=None, description="Temporal Cloud API key; implies TLS")
    tls: bool = False
    tls_cert: str | None = Field(default=None, description="client certificate (PEM) for mTLS")
    tls_key: str | None = None
    tls_ca: str | None = None


async def connect(settings: TemporalSettings, interceptors: Sequence[Interceptor] = ()) -> Client:
    """A client for `settings`; its `interceptors` (e.g. `workers.telemetry.interceptors`) apply to every
    call it makes and to every worker built from it."""
    tls: TLSConfig | bool = settings.tls or settings.api_key is not None
    if settings.tls_cert or settings.tls_ca:
        tls = TLSConfig(
            client_cert=_read(settings.tls_cert),
            client_private_key=_read(settings.tls_key),
            server_root_ca_cert=_read(settings.tls_ca),
        )
    return await Client.connect(
        settings.address,
        namespace=settings.namespace,
        api_key=settings.api_key,
        tls=tls,
        data_converter=pydantic_data_converter,
        interceptors=interceptors,
    )


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()
