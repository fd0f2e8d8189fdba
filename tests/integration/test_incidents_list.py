"""`torchpass incidents list` against a real dev server's visibility: a failure claim the job
refuted (outcome "not a failure") is no incident. It is left out of the list, which says how many
it left out, and `--refuted` lists those claims alone; a flood of forged claims used to bury the
incidents."""

from __future__ import annotations

import asyncio
import time

import pytest
from temporalio.common import SearchAttributeKey, SearchAttributePair, TypedSearchAttributes

from torchpass.cli import main
from torchpass.dev.server import start_dev_server
from torchpass.ids import SA_JOB_ID, SA_OUTCOME, WorkflowName

JOB = SearchAttributeKey.for_keyword(SA_JOB_ID)
OUTCOME = SearchAttributeKey.for_keyword(SA_OUTCOME)
RUNS = {
    "inc-migrated": "migrated",
    "inc-running": "running",
    "inc-refuted-1": "not_a_failure",
    "inc-refuted-2": "not_a_failure",
    "inc-bare": None,  # failed at its start, before it set its attributes
}


def _listed(out: str) -> set[str]:
    return {line.split()[0] for line in out.splitlines()[1:] if line and line[0] != "("}


async def test_refuted_claims_are_left_out_of_the_list_and_listed_apart(
    capsys: pytest.CaptureFixture[str],
) -> None:
    env = await start_dev_server()
    async with env:
        client = env.client
        for workflow_id, outcome in RUNS.items():
            pairs = [] if outcome is None else [SearchAttributePair(OUTCOME, outcome)]
            pairs += [] if outcome is None else [SearchAttributePair(JOB, "claimed")]
            await client.start_workflow(
                WorkflowName.MIGRATION,
                id=workflow_id,
                task_queue="nobody-serves-this",
                search_attributes=TypedSearchAttributes(pairs),
            )
        deadline = time.monotonic() + 10
        while (await client.count_workflows("WorkflowType = 'MigrationWorkflow'")).count < len(
            RUNS
        ):
            assert time.monotonic() < deadline, "the runs never became visible"
            await asyncio.sleep(0.1)
        address = client.service_client.config.target_host

        async def listing(*flags: str) -> str:
            argv = ["incidents", "list", "--address", address, *flags]
            assert await asyncio.to_thread(main, argv) == 0
            return capsys.readouterr().out

        out = await listing()
        assert _listed(out) == {"inc-migrated", "inc-running", "inc-bare"}, out
        assert "(2 failure claim(s) the job refuted left out: --refuted lists them)" in out
        out = await listing("--job", "claimed")
        assert _listed(out) == {"inc-migrated", "inc-running"} and "(2 failure claim(s)" in out
        out = await listing("--refuted")
        assert _listed(out) == {"inc-refuted-1", "inc-refuted-2"} and "left out" not in out
        assert _listed(await listing("--outcome", "not_a_failure")) == {
            "inc-refuted-1",
            "inc-refuted-2",
        }
        assert '"inc-refuted' not in await listing("--json")
