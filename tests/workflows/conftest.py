"""Workflow tier: the real time-skipping test server, job-side activities mocked under their real
names."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from tests.unit.job_driver import SHARED_PEERS
from torchpass.ids import SEARCH_ATTRIBUTES
from workers.server import temporal_binary


@pytest.fixture(scope="session")
async def env() -> AsyncIterator[WorkflowEnvironment]:
    async with time_skipping() as env:
        yield env


@pytest.fixture
async def own_env() -> AsyncIterator[WorkflowEnvironment]:
    """A time-skipping server of the test's own, for a test that pushes the server to its limits: a
    wedge there cannot spill into the tests after it."""
    async with time_skipping() as env:
        yield env


@asynccontextmanager
async def time_skipping() -> AsyncIterator[WorkflowEnvironment]:
    env = await WorkflowEnvironment.start_time_skipping(
        test_server_existing_path=temporal_binary("temporal-test-server"),
        data_converter=pydantic_data_converter,
    )
    SHARED_PEERS.add(env.client.service_client.config.target_host)
    async with env:
        # The workflow sets torchpass's search attributes; a server must know them (torchpass server
        # registers them on the dev server; here the test registers them).
        await env.client.operator_service.add_search_attributes(
            AddSearchAttributesRequest(
                namespace=env.client.namespace,
                search_attributes={
                    n: IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD for n in SEARCH_ATTRIBUTES
                },
            )
        )
        yield env


@pytest.fixture
def name(request: pytest.FixtureRequest) -> str:
    """The test's name: the file its workflow history is saved to."""
    return str(request.node.name)
