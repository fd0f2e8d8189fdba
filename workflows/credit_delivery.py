"""ContractWorkflow's credits delivered to billing, as a workflow step: the `deliver_credit`
activity on the control worker, once per pending credit, bounded so that a billing outage holds the
contract up for an hour at most. A credit billing does not take stays pending and is offered again
`REDELIVER_AFTER` later (that time travels in the contract's state, across continue-as-new)."""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from torchpass.contract.credit import CreditDelivery, CreditNotice
    from torchpass.contract.evaluation import Evaluations
    from torchpass.ids import ControlActivity
    from torchpass.policies import BILLING_RETRY, BILLING_TIMEOUTS
    from workflows.logs import logger
    from workflows.policy import retry_policy

# Billing may be down for days; a credit is owed until it says it has it. One delivery is
# BILLING_TIMEOUTS' attempt and heartbeat bounds and retry policy (1 s to 5 min apart), given up
# after an hour, not BILLING_TIMEOUTS' week: an outage must not keep an activity open (and its
# credit's retry time unknown) for days. The credit then stays pending and is offered again
# REDELIVER_AFTER later, as after a refusal no retry cures (a non-retryable error). Billing
# deduplicates on the idempotency key: re-offering is safe.
DELIVER_CREDIT_SCHEDULE_TO_CLOSE = timedelta(hours=1)
REDELIVER_AFTER = timedelta(hours=6)


async def deliver_credits(credits: Evaluations) -> None:
    """Offer the pending credits to billing in order; the first it does not take sets the next
    offer's time, and the rest wait for it too."""
    for notice in list(credits.pending_credits):
        delivery = await _deliver(notice)
        if delivery is None:
            # Carried in the state: a continue-as-new does not bring the next offer forward.
            credits.credit_retry_at = workflow.now() + REDELIVER_AFTER
            return
        credits.delivered(delivery)


async def _deliver(notice: CreditNotice) -> CreditDelivery | None:
    try:
        return await workflow.execute_activity(
            ControlActivity.DELIVER_CREDIT,
            notice,
            result_type=CreditDelivery,
            start_to_close_timeout=BILLING_TIMEOUTS.start_to_close,
            heartbeat_timeout=BILLING_TIMEOUTS.heartbeat,
            schedule_to_close_timeout=DELIVER_CREDIT_SCHEDULE_TO_CLOSE,
            retry_policy=retry_policy(BILLING_RETRY),
        )
    except ActivityError as e:
        logger.error(
            "credit %s not delivered, offered again in %s: %s",
            notice.idempotency_key,
            REDELIVER_AFTER,
            e.cause or e,
        )
        return None
