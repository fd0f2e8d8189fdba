"""Credits reach billing exactly once: real HTTP, real Temporal, nothing mocked.

What is real: the reference receiver (`torchpass.dev.billing_receiver`) on a loopback port,
verifying every signature and deduplicating by idempotency key; the real `deliver_credit` activity
posting to it over HTTP; a real Worker on the session's Temporal dev server, whose retry policy
(BILLING_RETRY with shorter intervals, so the test takes under a second) does the retrying. The only
test-only code is a one-activity workflow standing in for the contract workflow, and a "billing
system" workflow that waits for the signal.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import socket
import threading
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from temporalio import workflow
from temporalio.client import Client, WorkflowFailureError
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.worker import Worker

from activities.billing import BillingActivities
from activities.billing_settings import BillingSettings
from activities.webhook import http_post, send_webhook
from torchpass.contract.billing import (
    PermanentBillingError,
    TransientBillingError,
    canonical_body,
    signed_headers,
)
from torchpass.contract.credit import CreditDelivery, CreditNotice, Money, credit_idempotency_key
from torchpass.dev.billing_receiver import BillingReceiver
from torchpass.dev.billing_receiver import main as receiver_main
from torchpass.errors import ErrorType
from torchpass.ids import ControlActivity
from torchpass.policies import BILLING_RETRY, BILLING_TIMEOUTS
from workflows.policy import retry_policy

pytestmark = pytest.mark.integration
SECRET = "whsec-integration"
WAIT = 30  # seconds: the bound on every workflow the tests wait for

# The real policy, with intervals of 0.1 s, 0.2 s, 0.4 s ... instead of 1 s, 2 s, 4 s.
FAST_RETRY = retry_policy(
    dataclasses.replace(
        BILLING_RETRY, initial=timedelta(milliseconds=100), maximum=timedelta(seconds=1)
    )
)


@workflow.defn(name="TestDeliverCredit", sandboxed=False)
class DeliverCreditWorkflow:
    """Does what the contract workflow does with a notice: one deliver_credit activity, by name."""

    @workflow.run
    async def run(self, notice: CreditNotice) -> CreditDelivery:
        return await workflow.execute_activity(
            ControlActivity.DELIVER_CREDIT,
            notice,
            result_type=CreditDelivery,
            retry_policy=FAST_RETRY,
            start_to_close_timeout=BILLING_TIMEOUTS.start_to_close,
            heartbeat_timeout=BILLING_TIMEOUTS.heartbeat,
            schedule_to_close_timeout=timedelta(seconds=WAIT),
        )


@workflow.defn(name="TestBillingSystem", sandboxed=False)
class BillingSystemWorkflow:
    """Billing's own long-lived workflow: returns the first credit notice it is signalled."""

    def __init__(self) -> None:
        self.notices: list[CreditNotice] = []

    @workflow.signal(name="yoco_credit")
    def credit(self, notice: CreditNotice) -> None:
        self.notices.append(notice)

    @workflow.run
    async def run(self) -> list[CreditNotice]:
        await workflow.wait_condition(lambda: bool(self.notices), timeout=timedelta(seconds=WAIT))
        return self.notices


def notice(contract: str = "c-42") -> CreditNotice:
    period_end = date(2027, 3, 1)
    return CreditNotice(
        idempotency_key=credit_idempotency_key(contract, period_end),
        contract_id=contract,
        customer_id="acme",
        period_start=date(2026, 3, 1),
        period_end=period_end,
        trigger="renewal",
        success_rate=Decimal("0.8"),
        qualifying=10,
        successful=8,
        amount=Money(amount=Decimal("250000.00"), currency="EUR"),
        apply_to="next renewal",
        issued_at=datetime(2027, 3, 1, 9, 30, tzinfo=UTC),
    )


def settings(**kw: Any) -> BillingSettings:
    return BillingSettings.model_validate({"workflow_id": None, "webhook_url": None, **kw})


@asynccontextmanager
async def billing_worker(client: Client, s: BillingSettings) -> AsyncIterator[str]:
    queue = f"billing-test-{uuid.uuid4()}"
    acts = BillingActivities(s, client)
    async with Worker(
        client,
        task_queue=queue,
        workflows=[DeliverCreditWorkflow, BillingSystemWorkflow],
        activities=[acts.deliver_credit],
    ):
        yield queue


async def deliver(client: Client, queue: str, n: CreditNotice) -> CreditDelivery:
    wf_id = f"deliver-{uuid.uuid4()}"
    run = client.execute_workflow(DeliverCreditWorkflow.run, n, id=wf_id, task_queue=queue)
    return await asyncio.wait_for(run, WAIT)


async def last_attempt(client: Client, wf_id: str) -> int:
    history = await client.get_workflow_handle(wf_id).fetch_history()
    started = [e for e in history.events if e.HasField("activity_task_started_event_attributes")]
    return started[-1].activity_task_started_event_attributes.attempt


async def test_a_credit_is_accepted_exactly_once_through_failing_attempts_and_a_replay(
    client: Client,
) -> None:
    with BillingReceiver(SECRET, fail_first=3) as receiver:
        async with billing_worker(
            client, settings(webhook_url=receiver.url, webhook_secret=SECRET)
        ) as q:
            wf_id = f"deliver-{uuid.uuid4()}"
            run = client.execute_workflow(
                DeliverCreditWorkflow.run, notice(), id=wf_id, task_queue=q
            )
            first = await asyncio.wait_for(run, WAIT)
            replay = await deliver(client, q, notice())
            attempts = await last_attempt(client, wf_id)

    assert attempts == 4  # three 503s retried by Temporal's policy, not by a loop in the activity
    assert receiver.accepted == [notice()]
    assert first.webhook_status == 200 and not first.duplicate
    assert first.idempotency_key == "yoco-credit:c-42:2027-03-01"
    assert replay.duplicate and replay.webhook_status == 200
    assert receiver.duplicates == [notice().idempotency_key]
    assert receiver.attempts == 5 and receiver.rejected == []


async def test_two_deliveries_of_one_notice_at_once_make_one_credit(client: Client) -> None:
    with BillingReceiver(SECRET) as receiver:
        async with billing_worker(
            client, settings(webhook_url=receiver.url, webhook_secret=SECRET)
        ) as q:
            both = await asyncio.gather(*(deliver(client, q, notice("c-7")) for _ in range(2)))

    assert len(receiver.accepted) == 1 and receiver.duplicates == [notice("c-7").idempotency_key]
    assert sorted(d.duplicate for d in both) == [False, True]


async def test_a_wrong_secret_fails_the_workflow_at_once_with_a_typed_error(client: Client) -> None:
    with BillingReceiver("the-receivers-secret") as receiver:
        async with billing_worker(
            client, settings(webhook_url=receiver.url, webhook_secret="stale")
        ) as q:
            with pytest.raises(WorkflowFailureError) as failed:
                await deliver(client, q, notice())

    activity_error = failed.value.cause
    assert isinstance(activity_error, ActivityError)
    cause = activity_error.cause
    assert isinstance(cause, ApplicationError)
    assert cause.type == ErrorType.BILLING_REJECTED and cause.non_retryable
    assert "TORCHPASS_BILLING_WEBHOOK_SECRET" in cause.message and "HTTP 401" in cause.message
    assert receiver.attempts == 1 and receiver.accepted == []  # not retried
    assert receiver.rejected == ["signature does not match: wrong secret or altered body"]


async def test_billing_workflow_receives_exactly_the_notice_beside_the_webhook(
    client: Client,
) -> None:
    billing_id = f"billing-{uuid.uuid4()}"
    with BillingReceiver(SECRET) as receiver:
        s = settings(webhook_url=receiver.url, webhook_secret=SECRET, workflow_id=billing_id)
        async with billing_worker(client, s) as q:
            billing = await client.start_workflow(
                BillingSystemWorkflow.run, id=billing_id, task_queue=q
            )
            delivery = await deliver(client, q, notice())
            received = await asyncio.wait_for(billing.result(), WAIT)

    assert received == [notice()]
    assert delivery.billing_workflow_signalled and delivery.webhook_status == 200
    assert receiver.accepted == [notice()]


async def test_a_billing_workflow_that_is_not_running_is_a_typed_failure(client: Client) -> None:
    async with billing_worker(client, settings(workflow_id=f"no-such-{uuid.uuid4()}")) as q:
        with pytest.raises(WorkflowFailureError) as failed:
            await deliver(client, q, notice())

    assert isinstance(failed.value.cause, ActivityError)
    cause = failed.value.cause.cause
    assert isinstance(cause, ApplicationError) and cause.type == ErrorType.BILLING_REJECTED
    assert "is not running" in cause.message and "TORCHPASS_BILLING_WORKFLOW_ID" in cause.message


def test_a_captured_request_replayed_after_the_tolerance_is_refused() -> None:
    body = canonical_body(notice())
    with BillingReceiver(SECRET, tolerance_s=300) as receiver:
        old = signed_headers(notice(), body, SECRET, now=datetime.now(UTC).timestamp() - 301)
        reply = http_post(receiver.url, body, old, timeout=5)

    assert reply.status == 401 and b"tolerance" in reply.body
    assert receiver.accepted == []


def test_a_receiver_with_a_ledger_file_still_knows_a_key_after_a_restart(tmp_path: Path) -> None:
    ledger = tmp_path / "credits.json"
    with BillingReceiver(SECRET, ledger=ledger) as first:
        assert not send_webhook(
            settings(webhook_url=first.url, webhook_secret=SECRET), notice()
        ).duplicate
    with BillingReceiver(SECRET, ledger=ledger) as second:
        assert send_webhook(
            settings(webhook_url=second.url, webhook_secret=SECRET), notice()
        ).duplicate

    assert [n.idempotency_key for n in first.accepted] == [notice().idempotency_key]
    assert second.accepted == [] and second.duplicates == [notice().idempotency_key]


def test_a_refused_connection_and_a_silent_server_are_transient() -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with pytest.raises(TransientBillingError, match="unreachable") as e:
        http_post(
            f"http://user:pw@127.0.0.1:{port}/credits?token=s3cr3t#frag", b"{}", {}, timeout=2
        )
    # The error lands in the workflow's history: no query token or credentials in it.
    assert f"http://127.0.0.1:{port}/credits unreachable" in str(e.value)
    assert "s3cr3t" not in str(e.value) and "pw" not in str(e.value) and e.value.__cause__ is None
    # Listening but never answering: the connection is queued by the kernel, the read times out.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/"
        with pytest.raises(TransientBillingError, match="unreachable"):
            http_post(url, b"{}", {}, timeout=0.3)


def _raw_http(url: str, request: bytes, wait: float = 5.0) -> bytes:
    """Bytes a real client would never send, and what the server answers until it hangs up (b"" if
    it says nothing); a server still holding the connection after `wait` seconds fails the test."""
    host, port = url.split("//")[1].split("/", maxsplit=1)[0].split(":")
    with socket.create_connection((host, int(port)), timeout=wait) as s:
        s.sendall(request)
        chunks = []
        try:
            while chunk := s.recv(65536):
                chunks.append(chunk)
        except TimeoutError:
            pytest.fail(
                f"the server neither answered nor hung up within {wait} s: {b''.join(chunks)!r}"
            )
        except ConnectionError:
            pass  # reset: hung up
    return b"".join(chunks)


def test_the_reference_receiver_answers_absurd_requests_and_drops_silent_ones() -> None:
    read_timeout = 0.5
    with BillingReceiver(SECRET, read_timeout=read_timeout) as receiver:
        huge = "9" * 5000
        answer = _raw_http(
            receiver.url, f"POST /credits HTTP/1.1\r\nContent-Length: {huge}\r\n\r\n".encode()
        )
        assert answer.startswith(b"HTTP/1.0 413")
        body = canonical_body(notice())
        headers = {**signed_headers(notice(), body, SECRET), "X-Torchpass-Timestamp": huge}
        reply = http_post(receiver.url, body, headers, timeout=5)
        assert reply.status == 401 and b"malformed" in reply.body
        # A request never finished: dropped at the receiver's read timeout, well before the
        # client's.
        assert _raw_http(receiver.url, b"POST /credits HTTP/1.1\r\n", wait=5 * read_timeout) == b""
    with pytest.raises(ValueError, match="at least 16 characters"):
        BillingReceiver("short")


def test_the_reference_receivers_command_needs_a_ledger_or_says_it_forgets(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TORCHPASS_BILLING_WEBHOOK_SECRET", SECRET)
    with pytest.raises(SystemExit):
        receiver_main(["--port", "0"])
    assert "--ledger" in capsys.readouterr().err
    monkeypatch.setenv("TORCHPASS_BILLING_WEBHOOK_SECRET", "short")
    with pytest.raises(SystemExit):
        receiver_main(["--port", "0", "--in-memory"])
    assert "at least 16 characters" in capsys.readouterr().err


class _Redirect(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.send_response(307)
        self.send_header("Location", "http://127.0.0.1:1/elsewhere")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_a_redirect_is_not_followed_and_is_a_permanent_refusal() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Redirect)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/credits"
        with pytest.raises(PermanentBillingError, match="HTTP 307"):
            send_webhook(settings(webhook_url=url, webhook_secret=SECRET), notice())
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


SANDBOXED = """
from temporalio import workflow
from torchpass.policies import BILLING_RETRY  # not passed through: re-imported inside the sandbox
from workflows.policy import retry_policy

@workflow.defn(name="TestBillingPolicyInSandbox")
class PolicyWorkflow:
    @workflow.run
    async def run(self) -> float:
        return retry_policy(BILLING_RETRY).maximum_interval.total_seconds()
"""


async def test_a_sandboxed_workflow_can_import_the_billing_policy(
    client: Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The contract workflow imports the billing policy; Temporal's sandbox must accept the
    modules."""
    (tmp_path / "billing_policy_wf.py").write_text(SANDBOXED)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("billing_policy_wf")
    queue = f"billing-sandbox-{uuid.uuid4()}"
    async with Worker(client, task_queue=queue, workflows=[module.PolicyWorkflow]):
        run = client.execute_workflow(
            "TestBillingPolicyInSandbox", id=queue, task_queue=queue, result_type=float
        )
        assert await asyncio.wait_for(run, WAIT) == 300.0
