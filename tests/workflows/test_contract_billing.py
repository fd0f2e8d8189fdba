"""A contract year below 90% ends in exactly one credit accepted by a real billing webhook.

Everything on the delivery path is real: ContractWorkflow's own renewal timer and delivery policy,
the production `deliver_credit` activity (BillingActivities) signing real HTTP requests, and the
reference receiver (torchpass.dev.billing_receiver) that verifies signatures, refuses the first
attempts with 503 and deduplicates by idempotency key. Time is skipped by the Temporal test server.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from activities.billing import BillingActivities
from activities.billing_settings import BillingSettings
from tests.workflows.test_contract import CUSTOMER, TRUSTING, Contract, _start_day
from torchpass.contract.credit import credit_idempotency_key
from torchpass.contract.rules import day_start
from torchpass.contract.terms import RenewInput
from torchpass.dev.billing_receiver import BillingReceiver
from workers import contract_client as cc
from workflows.contract import CONTRACT_WORKFLOWS

SECRET = "whsec-test-contract-billing"


async def test_a_renewal_below_ninety_percent_is_credited_once_through_the_real_webhook(
    env: WorkflowEnvironment,
) -> None:
    start = await _start_day(env)
    c = Contract(env, start)
    with BillingReceiver(SECRET, fail_first=2) as receiver:
        settings = BillingSettings(webhook_url=receiver.url, webhook_secret=SECRET)
        billing = BillingActivities(settings, env.client)
        async with Worker(
            env.client,
            task_queue=c.queue,
            workflows=CONTRACT_WORKFLOWS,
            activities=[billing.deliver_credit, *TRUSTING],
        ):
            await c.create()
            await c.cover("job-a")
            since = await env.get_current_time()
            await c.advance_to(start + timedelta(days=200))
            await c.send(since, 20, failures=4)  # 16/20 = 80%: a credit at renewal
            await cc.renew(c.client, CUSTOMER, c.id, RenewInput())
            renewal = c.terms.renewal_date
            await env.sleep(day_start(renewal) + timedelta(hours=2) - await env.get_current_time())
            for _ in range(100):
                standing = await cc.get_standing(c.client, CUSTOMER, c.id)
                if standing.delivered_credits:
                    break
                await asyncio.sleep(0.05)
    key = credit_idempotency_key(c.id, renewal)
    assert standing.delivered_credits == (key,) and standing.pending_credits == 0
    assert [n.idempotency_key for n in receiver.accepted] == [key]  # exactly one accepted
    assert receiver.attempts >= 3  # the first two were refused with 503 and retried
    (notice,) = receiver.accepted
    assert (notice.qualifying, notice.successful) == (20, 16) and str(
        notice.amount
    ) == "30,000.00 USD"
