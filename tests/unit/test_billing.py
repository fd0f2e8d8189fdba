"""Billing without a network or Temporal: canonical body, signing, verification, answers, settings.

Signatures are checked against HMAC-SHA256 computed here from the documented scheme, so a change to
the scheme that a billing team's receiver would not follow fails a test.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from pydantic import ValidationError

from activities.billing_settings import BillingSettings
from activities.webhook import send_webhook
from torchpass.contract.billing import (
    BillingNotConfigured,
    HttpReply,
    PermanentBillingError,
    SignatureRejected,
    TransientBillingError,
    WebhookAck,
    canonical_body,
    interpret,
    sign,
    signed_headers,
    verify,
)
from torchpass.contract.credit import CreditNotice, Money, credit_idempotency_key
from torchpass.errors import ErrorType
from torchpass.policies import BILLING_RETRY, BILLING_TIMEOUTS, MAX_WEBHOOK_TIMEOUT_S

SECRET = "whsec-test"
NOW = 1_800_000_000


def notice(**kw: Any) -> CreditNotice:
    fields: dict[str, Any] = {
        "idempotency_key": credit_idempotency_key("c-1", date(2027, 1, 1)),
        "contract_id": "c-1",
        "customer_id": "acme",
        "period_start": date(2026, 1, 1),
        "period_end": date(2027, 1, 1),
        "trigger": "renewal",
        "success_rate": Decimal("0.85"),
        "qualifying": 20,
        "successful": 17,
        "amount": Money(amount=Decimal("125000.00"), currency="USD"),
        "apply_to": "next renewal",
        "issued_at": datetime(2027, 1, 1, 0, 0, 5, tzinfo=UTC),
        **kw,
    }
    return CreditNotice.model_validate(fields)


def test_canonical_body_is_sorted_compact_and_carries_money_as_strings() -> None:
    body = canonical_body(notice())
    assert body == (
        b'{"amount":{"amount":"125000.00","currency":"USD"},"apply_to":"next renewal",'
        b'"contract_id":"c-1","customer_id":"acme","idempotency_key":"yoco-credit:c-1:2027-01-01",'
        b'"issued_at":"2027-01-01T00:00:05Z","period_end":"2027-01-01","period_start":"2026-01-01",'
        b'"qualifying":20,"success_rate":"0.85","successful":17,"trigger":"renewal"}'
    )
    assert CreditNotice.model_validate_json(body) == notice()


def test_the_same_notice_built_in_another_field_order_has_the_same_body() -> None:
    reordered = CreditNotice.model_validate(dict(reversed(list(notice().model_dump().items()))))
    assert canonical_body(reordered) == canonical_body(notice())
    assert canonical_body(notice(successful=16)) != canonical_body(notice())


def test_the_signature_is_hmac_sha256_over_timestamp_dot_body() -> None:
    body = canonical_body(notice())
    expected = hmac.new(SECRET.encode(), f"{NOW}.".encode() + body, hashlib.sha256).hexdigest()
    assert sign(body, NOW, SECRET) == expected
    headers = signed_headers(notice(), body, SECRET, now=NOW + 0.7)
    assert headers["X-Torchpass-Signature"] == f"v1={expected}"
    assert headers["X-Torchpass-Timestamp"] == str(NOW)
    assert headers["Idempotency-Key"] == "yoco-credit:c-1:2027-01-01"


def _signed(now: float = NOW, secret: str = SECRET) -> tuple[bytes, dict[str, str]]:
    body = canonical_body(notice())
    return body, signed_headers(notice(), body, secret, now=now)


def test_a_signed_notice_verifies_with_any_header_case() -> None:
    body, headers = _signed()
    verify(body, headers, SECRET, now=NOW + 10)
    verify(body, {k.lower(): v for k, v in headers.items()}, SECRET, now=NOW + 10)


def test_a_wrong_secret_or_an_altered_body_is_rejected() -> None:
    body, headers = _signed(secret="other")
    with pytest.raises(SignatureRejected, match="wrong secret or altered body"):
        verify(body, headers, SECRET, now=NOW)
    body, headers = _signed()
    with pytest.raises(SignatureRejected, match="does not match"):
        verify(body.replace(b"125000.00", b"925000.00"), headers, SECRET, now=NOW)


@pytest.mark.parametrize("skew", [301, -301, 86_400])
def test_a_timestamp_outside_the_tolerance_is_a_rejected_replay(skew: int) -> None:
    body, headers = _signed()
    with pytest.raises(SignatureRejected, match="tolerance"):
        verify(body, headers, SECRET, tolerance_s=300, now=NOW + skew)


def test_missing_or_malformed_headers_are_rejected() -> None:
    body, headers = _signed()
    without_ts = {k: v for k, v in headers.items() if k != "X-Torchpass-Timestamp"}
    with pytest.raises(SignatureRejected, match="missing or malformed X-Torchpass-Timestamp"):
        verify(body, without_ts, SECRET, now=NOW)
    # Full-width digits pass str.isdigit() and int(); a timestamp is ASCII digits only.
    with pytest.raises(SignatureRejected, match="missing or malformed X-Torchpass-Timestamp"):
        verify(body, {**headers, "X-Torchpass-Timestamp": "\uff11\uff12\uff13"}, SECRET, now=NOW)
    with pytest.raises(SignatureRejected, match="does not match"):
        verify(body, {**headers, "X-Torchpass-Signature": ""}, SECRET, now=NOW)
    bare = headers["X-Torchpass-Signature"].removeprefix("v1=")
    with pytest.raises(SignatureRejected, match="does not match"):
        verify(body, {**headers, "X-Torchpass-Signature": f"v0={bare}"}, SECRET, now=NOW)


def test_a_header_with_two_signatures_verifies_during_secret_rotation() -> None:
    body, headers = _signed()
    sig = headers["X-Torchpass-Signature"]
    verify(body, {**headers, "X-Torchpass-Signature": f"v1=deadbeef, {sig}"}, SECRET, now=NOW)


@pytest.mark.parametrize(
    ("status", "body", "duplicate"),
    [
        (200, b'{"accepted": true}', False),
        (200, b'{"duplicate": true}', True),
        (201, b"", False),
        (202, b"ok, not json", False),
        (200, b'{"duplicate": "yes"}', False),  # only a JSON true says duplicate
        (409, b"", True),
    ],
)
def test_acknowledgements(status: int, body: bytes, duplicate: bool) -> None:
    assert interpret(HttpReply(status, body)) == WebhookAck(status, duplicate)


@pytest.mark.parametrize("status", [500, 502, 503, 504, 408, 425, 429])
def test_server_errors_and_throttling_are_transient(status: int) -> None:
    with pytest.raises(TransientBillingError, match=f"HTTP {status}") as e:
        interpret(HttpReply(status, b'{"error": "busy"}'))
    assert e.value.retryable and "busy" in str(e.value)


@pytest.mark.parametrize("status", [401, 403])
def test_a_refused_signature_is_permanent_and_names_the_secret(status: int) -> None:
    with pytest.raises(PermanentBillingError, match="TORCHPASS_BILLING_WEBHOOK_SECRET") as e:
        interpret(HttpReply(status, b'{"error": "signature does not match"}'))
    assert not e.value.retryable and e.value.error_type == ErrorType.BILLING_REJECTED
    assert "signature does not match" in str(e.value) and "not retried" in str(e.value)


@pytest.mark.parametrize("status", [400, 404, 410, 301, 307])
def test_other_refusals_are_permanent_and_name_the_url(status: int) -> None:
    with pytest.raises(PermanentBillingError, match="TORCHPASS_BILLING_WEBHOOK_URL"):
        interpret(HttpReply(status, b"<html>nope</html>"))


def _clear_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("WEBHOOK_URL", "WEBHOOK_SECRET", "WORKFLOW_ID"):
        monkeypatch.delenv(f"TORCHPASS_BILLING_{var}", raising=False)


def test_a_url_needs_a_secret_and_settings_come_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _clear_env(monkeypatch)
    with pytest.raises(ValidationError, match="WEBHOOK_SECRET is required"):
        BillingSettings(webhook_url="https://billing.example/credits")
    monkeypatch.setenv("TORCHPASS_BILLING_WEBHOOK_URL", "https://billing.example/credits")
    monkeypatch.setenv("TORCHPASS_BILLING_WEBHOOK_SECRET", "s3cret")
    monkeypatch.setenv("TORCHPASS_BILLING_WORKFLOW_ID", "billing-main")
    s = BillingSettings()
    assert str(s.webhook_url) == "https://billing.example/credits" and s.configured
    assert s.workflow_id == "billing-main" and s.signal_name == "yoco_credit"
    assert "s3cret" not in repr(s)  # SecretStr: never in a log line


def test_nothing_configured_is_a_permanent_error(monkeypatch: pytest.MonkeyPatch) -> None:
    _clear_env(monkeypatch)
    s = BillingSettings()
    assert not s.configured
    with pytest.raises(BillingNotConfigured) as e:
        send_webhook(s, notice())
    assert e.value.error_type in BILLING_RETRY.non_retryable


def test_the_retry_policy_retries_until_acknowledged_and_stops_only_on_refusals() -> None:
    assert BILLING_RETRY.attempts == 0  # unlimited
    assert BILLING_RETRY.maximum == timedelta(minutes=5)
    non_retryable = set(BILLING_RETRY.non_retryable)
    assert PermanentBillingError.error_type in non_retryable
    assert BillingNotConfigured.error_type in non_retryable
    assert TransientBillingError.error_type not in non_retryable


def test_one_webhook_attempt_fits_in_the_heartbeat_and_attempt_timeouts() -> None:
    assert BILLING_TIMEOUTS.heartbeat is not None
    assert (
        timedelta(seconds=MAX_WEBHOOK_TIMEOUT_S)
        < BILLING_TIMEOUTS.heartbeat
        < BILLING_TIMEOUTS.start_to_close
    )
    BillingSettings(timeout=MAX_WEBHOOK_TIMEOUT_S)
    with pytest.raises(ValidationError):
        BillingSettings(timeout=MAX_WEBHOOK_TIMEOUT_S + 0.1)


def test_the_body_is_valid_json_a_receiver_can_read_without_torchpass() -> None:
    data = json.loads(canonical_body(notice()))
    assert Decimal(data["amount"]["amount"]) == Decimal("125000.00")
    assert data["idempotency_key"] == "yoco-credit:c-1:2027-01-01"
