"""deliver_credit: one credit notice to billing, by signed webhook and/or a signal to billing's
workflow.

Idempotent by construction: every attempt carries the notice's idempotency key (contract + period),
so a retry after a partial success (webhook accepted, then the worker died) is answered as a
duplicate by billing, never counted twice. A billing workflow that receives the signal twice must
deduplicate on the same key. The retry policy and timeouts the contract workflow uses live in
`torchpass.policies`.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

from temporalio import activity
from temporalio.client import Client
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from activities.billing_settings import BillingSettings
from activities.webhook import send_webhook
from torchpass.contract.billing import (
    BillingError,
    BillingNotConfigured,
    PermanentBillingError,
    TransientBillingError,
    WebhookAck,
)
from torchpass.contract.credit import CreditDelivery, CreditNotice
from torchpass.ids import ControlActivity


class BillingActivities:
    """Built by the control worker with its billing settings and, to signal billing's workflow, a
    client.

    The client must use the pydantic data converter (as `workers.temporal.connect` does) and be
    connected to the namespace of billing's workflow.
    """

    def __init__(self, settings: BillingSettings, client: Client | None = None) -> None:
        if settings.workflow_id is not None and client is None:
            # Fail at worker start-up, not on the first credit months later.
            raise ValueError(
                "TORCHPASS_BILLING_WORKFLOW_ID is set: BillingActivities needs a Temporal client"
            )
        self._s = settings
        self._client = client

    @activity.defn(name=ControlActivity.DELIVER_CREDIT)
    async def deliver_credit(self, notice: CreditNotice) -> CreditDelivery:
        try:
            return await self._deliver(notice)
        except BillingError as e:
            # Transient -> retried by BILLING_RETRY_POLICY until acknowledged; permanent -> stops at
            # once.
            raise ApplicationError(
                str(e), type=e.error_type.value, non_retryable=not e.retryable
            ) from e

    async def _deliver(self, notice: CreditNotice) -> CreditDelivery:
        if not self._s.configured:
            raise BillingNotConfigured(
                "no billing destination: set TORCHPASS_BILLING_WEBHOOK_URL "
                "and/or TORCHPASS_BILLING_WORKFLOW_ID"
            )
        ack: WebhookAck | None = None
        if self._s.webhook_url is not None:
            activity.heartbeat("webhook")
            ack = await asyncio.to_thread(send_webhook, self._s, notice)
            activity.logger.info(
                "credit %s acknowledged by webhook: HTTP %d%s",
                notice.idempotency_key,
                ack.status,
                " (duplicate)" if ack.duplicate else "",
            )
        if self._s.workflow_id is not None:
            activity.heartbeat("signal")
            await self._signal(self._s.workflow_id, notice)
        return CreditDelivery(
            idempotency_key=notice.idempotency_key,
            webhook_status=ack.status if ack else None,
            duplicate=ack.duplicate if ack else False,
            billing_workflow_signalled=self._s.workflow_id is not None,
            delivered_at=datetime.now(UTC),
        )

    async def _signal(self, workflow_id: str, notice: CreditNotice) -> None:
        assert self._client is not None  # guaranteed by __init__
        handle = self._client.get_workflow_handle(workflow_id)
        try:
            await handle.signal(
                self._s.signal_name, notice, rpc_timeout=timedelta(seconds=self._s.timeout)
            )
        except RPCError as e:
            if e.status == RPCStatusCode.NOT_FOUND:
                raise PermanentBillingError(
                    f"billing workflow {workflow_id!r} is not running; not retried: check "
                    "TORCHPASS_BILLING_WORKFLOW_ID and the Temporal namespace of the worker's "
                    "client"
                ) from e
            raise TransientBillingError(
                f"signal to billing workflow {workflow_id!r} failed: {e}"
            ) from e
