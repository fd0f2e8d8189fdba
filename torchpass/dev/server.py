"""The embedded Temporal dev server on loopback, for the demo, the benchmarks and the tests."""

from __future__ import annotations

from temporalio.common import SearchAttributeKey
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from torchpass.ids import SEARCH_ATTRIBUTES
from workers.server import temporal_binary


async def start_dev_server(ui_port: int | None = None) -> WorkflowEnvironment:
    """The dev server with torchpass's search attributes registered; nothing is downloaded."""
    return await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_binary(),
        ip="127.0.0.1",
        ui=ui_port is not None,
        ui_port=ui_port,
        search_attributes=[SearchAttributeKey.for_keyword(n) for n in SEARCH_ATTRIBUTES],
        data_converter=pydantic_data_converter,
        dev_server_log_level="error",
    )
