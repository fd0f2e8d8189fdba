"""Credit notices to billing: settings, the signed webhook, how billing's answers are read.

No Temporal here beyond the retry policy's type: the activity (`activities.billing`) and the reference
receiver (`torchpass.billing_receiver`) both build on these functions, so that sender and receiver cannot
disagree on the body, the signature or what an answer means.

Signing scheme (v1, Stripe-like):

- body: the notice as canonical JSON: keys sorted, no whitespace, UTF-8, Decimals as strings, dates ISO 8601
- `X-Torchpass-Timestamp: <unix seconds>`
- `X-Torchpass-Signature: v1=<hex HMAC-SHA256(secret, f"{timestamp}." + body)>`
- `Idempotency-Key: <notice.idempotency_key>` (contract + period): the key billing deduplicates on

The timestamp is signed with the body so that a captured request cannot be replayed after the receiver's
tolerance; within it, the idempotency key makes a replay a recognisable duplicate.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import http.client
import json
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

from pydantic import AnyHttpUrl, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from temporalio.common import RetryPolicy

from torchpass.credit import CreditNotice
from torchpass.decisions import ActivityTimeouts

SIGNATURE_HEADER = "X-Torchpass-Signature"
TIMESTAMP_HEADER = "X-Torchpass-Timestamp"
IDEMPOTENCY_HEADER = "Idempotency-Key"
SIGNATURE_VERSION = "v1"
DEFAULT_SIGNAL_NAME = "yoco_credit"
DEFAULT_TOLERANCE_S = 300.0
_MAX_REPLY_BYTES = 64 * 1024
# One webhook attempt blocks at most this long; it stays under the activity's heartbeat timeout below.
MAX_WEBHOOK_TIMEOUT_S = 25.0


class BillingErrorType:
    """ApplicationError types of the deliver_credit activity."""

    UNAVAILABLE = "BillingUnavailable"
    REJECTED = "BillingRejected"
    NOT_CONFIGURED = "BillingNotConfigured"


class BillingError(Exception):
    """Base of billing errors; `retryable` carries the retry decision to the activity."""

    retryable = False
    error_type = BillingErrorType.REJECTED


class TransientBillingError(BillingError):
    """Billing is down, slow or overloaded: retry, the idempotency key makes it safe."""

    retryable = True
    error_type = BillingErrorType.UNAVAILABLE


class PermanentBillingError(BillingError):
    """No retry can cure it (wrong secret, wrong URL, a notice billing refuses): an operator must act."""


class BillingNotConfigured(PermanentBillingError):
    error_type = BillingErrorType.NOT_CONFIGURED


class SignatureRejected(PermanentBillingError):
    """A receiver refuses a request: bad or missing signature, or a timestamp outside the tolerance."""


class BillingSettings(BaseSettings):
    """TORCHPASS_BILLING_* variables; validated once when the control worker starts."""

    model_config = SettingsConfigDict(env_prefix="TORCHPASS_BILLING_", extra="ignore")

    webhook_url: AnyHttpUrl | None = Field(default=None, description="where credit notices are POSTed")
    webhook_secret: SecretStr | None = Field(default=None, description="HMAC key shared with the receiver")
    timeout: float = Field(default=10.0, gt=0, le=MAX_WEBHOOK_TIMEOUT_S, description="seconds per attempt")
    workflow_id: str | None = Field(default=None, description="billing's own Temporal workflow to signal")
    signal_name: str = Field(default=DEFAULT_SIGNAL_NAME, min_length=1)

    @model_validator(mode="after")
    def _secret_with_url(self) -> BillingSettings:
        if self.webhook_url is not None and not (
            self.webhook_secret and self.webhook_secret.get_secret_value()
        ):
            raise ValueError("TORCHPASS_BILLING_WEBHOOK_SECRET is required when a webhook URL is set")
        return self

    @property
    def configured(self) -> bool:
        return self.webhook_url is not None or self.workflow_id is not None


# Retried until billing acknowledges: exponential from 1 s up to 5 min between attempts, no attempt limit;
# only a refusal no retry can cure stops it. The schedule-to-close bound makes an outage of a week surface
# in the contract workflow as a typed failure instead of a silent wait; re-issuing the same notice is safe.
BILLING_NON_RETRYABLE_ERROR_TYPES: tuple[str, ...] = (
    BillingErrorType.REJECTED,
    BillingErrorType.NOT_CONFIGURED,
)
BILLING_RETRY_POLICY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(minutes=5),
    maximum_attempts=0,
    non_retryable_error_types=list(BILLING_NON_RETRYABLE_ERROR_TYPES),
)
BILLING_TIMEOUTS = ActivityTimeouts(
    start_to_close=timedelta(seconds=60),
    schedule_to_close=timedelta(days=7),
    heartbeat=timedelta(seconds=30),
)


def canonical_body(notice: CreditNotice) -> bytes:
    """The notice as deterministic bytes: the same notice always signs to the same signature."""
    data = notice.model_dump(mode="json")  # Decimal -> str, date -> ISO: no float ever carries money
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def sign(body: bytes, timestamp: int, secret: str) -> str:
    """Hex HMAC-SHA256 over `f"{timestamp}."` followed by the body."""
    return hmac.new(secret.encode("utf-8"), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()


def signed_headers(
    notice: CreditNotice, body: bytes, secret: str, now: float | None = None
) -> dict[str, str]:
    ts = int(time.time() if now is None else now)
    return {
        "Content-Type": "application/json",
        TIMESTAMP_HEADER: str(ts),
        SIGNATURE_HEADER: f"{SIGNATURE_VERSION}={sign(body, ts, secret)}",
        IDEMPOTENCY_HEADER: notice.idempotency_key,
    }


def verify(
    body: bytes,
    headers: Mapping[str, str],
    secret: str,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
    now: float | None = None,
) -> None:
    """Raise SignatureRejected unless the body was signed with `secret` within `tolerance_s` of `now`."""
    lower = {k.lower(): v for k, v in headers.items()}
    raw_ts = lower.get(TIMESTAMP_HEADER.lower(), "")
    if not (raw_ts.isascii() and raw_ts.isdigit()):
        raise SignatureRejected(f"missing or malformed {TIMESTAMP_HEADER}")
    ts = int(raw_ts)
    current = time.time() if now is None else now
    if abs(current - ts) > tolerance_s:
        raise SignatureRejected(
            f"timestamp {ts} is outside the {tolerance_s:g} s tolerance (replay or clock skew)"
        )
    expected = sign(body, ts, secret)
    offered = _signatures(lower.get(SIGNATURE_HEADER.lower(), ""))
    # compare_digest: a byte-by-byte compare would leak how much of a forged signature was right.
    if not any(hmac.compare_digest(expected, s) for s in offered):
        raise SignatureRejected("signature does not match: wrong secret or altered body")


def _signatures(header: str) -> list[str]:
    """The v1 signatures of a header such as `v1=ab12,v1=cd34` (two while a secret is being rotated)."""
    prefix = f"{SIGNATURE_VERSION}="
    return [p.strip()[len(prefix) :] for p in header.split(",") if p.strip().startswith(prefix)]


@dataclass(frozen=True)
class HttpReply:
    status: int
    body: bytes


@dataclass(frozen=True)
class WebhookAck:
    status: int
    duplicate: bool


@functools.cache
def _opener() -> urllib.request.OpenerDirector:
    # Built on first use, not at import: the contract workflow imports this module for its retry policy,
    # and Temporal's sandbox refuses a module that subclasses urllib's handlers when it is imported.
    class NoRedirect(urllib.request.HTTPRedirectHandler):
        # A redirected POST would be replayed as a GET without its body: the URL must be the final one.
        def redirect_request(self, *args: object, **kwargs: object) -> None:
            return None

    return urllib.request.build_opener(NoRedirect)


def http_post(url: str, body: bytes, headers: Mapping[str, str], timeout: float) -> HttpReply:
    """Every billing HTTP call goes through here. Blocking: the activity runs it in a thread."""
    req = urllib.request.Request(url, data=body, headers=dict(headers), method="POST")
    try:
        with _opener().open(req, timeout=timeout) as resp:
            return HttpReply(resp.status, resp.read(_MAX_REPLY_BYTES))
    except urllib.error.HTTPError as e:  # a status outside 2xx: an answer, read by interpret()
        with e:
            return HttpReply(e.code, e.read(_MAX_REPLY_BYTES))
    except (OSError, http.client.HTTPException) as e:  # refused, reset, DNS, timeout: no answer at all
        reason = e.reason if isinstance(e, urllib.error.URLError) else e
        raise TransientBillingError(f"billing webhook {url} unreachable: {reason!r}") from e


def interpret(reply: HttpReply) -> WebhookAck:
    """What billing's answer means: acknowledged (maybe as a duplicate), retry later, or never."""
    if 200 <= reply.status < 300:
        return WebhookAck(reply.status, duplicate=_says_duplicate(reply.body))
    if reply.status == 409:  # the key was accepted before: that is an acknowledgement too
        return WebhookAck(reply.status, duplicate=True)
    detail = _detail(reply.body)
    if reply.status >= 500 or reply.status in (408, 425, 429):
        raise TransientBillingError(f"billing webhook answered HTTP {reply.status}: {detail}")
    if reply.status in (401, 403):
        raise PermanentBillingError(
            f"billing webhook refused the signature (HTTP {reply.status}: {detail}); not retried: check that "
            "TORCHPASS_BILLING_WEBHOOK_SECRET matches the receiver's secret and that this host's clock is "
            "right"
        )
    raise PermanentBillingError(
        f"billing webhook refused the notice (HTTP {reply.status}: {detail}); not retried: check "
        "TORCHPASS_BILLING_WEBHOOK_URL and the receiver"
    )


def _json(body: bytes) -> object:
    try:
        return json.loads(body)
    except ValueError:
        return None


def _says_duplicate(body: bytes) -> bool:
    data = _json(body)
    return isinstance(data, dict) and data.get("duplicate") is True


def _detail(body: bytes) -> str:
    data = _json(body)
    if isinstance(data, dict) and isinstance(data.get("error"), str):
        return data["error"]
    return body[:200].decode("utf-8", "replace") or "no body"


def send_webhook(settings: BillingSettings, notice: CreditNotice, now: float | None = None) -> WebhookAck:
    """POST one signed notice once; raise a BillingError unless billing acknowledged it."""
    if settings.webhook_url is None or settings.webhook_secret is None:
        raise BillingNotConfigured("no billing webhook configured (TORCHPASS_BILLING_WEBHOOK_URL)")
    body = canonical_body(notice)
    headers = signed_headers(notice, body, settings.webhook_secret.get_secret_value(), now)
    return interpret(http_post(str(settings.webhook_url), body, headers, settings.timeout))
