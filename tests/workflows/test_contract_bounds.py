"""A contract's history stays bounded whatever is sent to it: outcomes past the size limits are
refused at the door (counted, never stored), so continue-as-new always fits. The time-skipping
server and the real ContractWorkflow; histories saved as test_contract's are."""

from __future__ import annotations

import asyncio

from temporalio.client import WorkflowExecutionStatus
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from tests.workflows.test_contract import CUSTOMER, TRUSTING, Contract, FakeBilling, _start_day
from torchpass.ids import ContractMessage
from workers import contract_client as cc
from workflows.contract import CONTRACT_WORKFLOWS


async def test_oversized_outcomes_are_refused_and_continue_as_new_still_fits(
    own_env: WorkflowEnvironment, name: str
) -> None:
    env = own_env
    c = Contract(env, await _start_day(env), cas_after=5)
    billing = FakeBilling()
    # Every signal is in before a worker runs: the contract takes them in one go and then continues
    # as new (signals racing a continue-as-new have wedged the time-skipping server).
    handle = await c.create()
    now = await env.get_current_time()
    for _ in range(3):  # ids of 20 KB: an unbounded ledger carried them into every next run
        huge = c.outcome(now).model_dump(mode="json") | {"incident_id": "x" * 20_000}
        await handle.signal(ContractMessage.RECORD_OUTCOME, huge)
    for _ in range(4):
        await cc.record_outcome(c.client, CUSTOMER, c.id, c.outcome(now))
    async with Worker(
        env.client,
        task_queue=c.queue,
        workflows=CONTRACT_WORKFLOWS,
        activities=[billing.deliver, *TRUSTING],
    ):
        # Asked nothing until it continued as new: a query racing that workflow task can time out.
        first = c.client.get_workflow_handle(handle.id, run_id=handle.result_run_id)
        for _ in range(400):
            if (await first.describe()).status is WorkflowExecutionStatus.CONTINUED_AS_NEW:
                break
            await asyncio.sleep(0.05)
        standing = await c.standing()
        await handle.terminate("test done")
    await c.save(name, handle.result_run_id or "")
    # it continued as new, the refused outcomes left out of what it carried
    assert standing.runs >= 1
    assert standing.rejected_signals == 3
    # the valid ones are kept (their job is not covered)
    assert sum(standing.excluded.values()) == 4
