"""Credit notices to billing: the signed body, how a receiver verifies it, what billing's answers
mean.

Pure: no I/O and no Temporal. The sender (`activities.webhook`, used by the `deliver_credit`
activity) and the reference receiver (`torchpass.dev.billing_receiver`) both build on these
functions, so that sender and receiver cannot disagree on the body, the signature or what an answer
means.

Signing scheme (v1, Stripe-like):

- body: the notice as canonical JSON: keys sorted, no whitespace, UTF-8, Decimals as strings, dates
  ISO 8601
- `X-Torchpass-Timestamp: <unix seconds>`
- `X-Torchpass-Signature: v1=<hex HMAC-SHA256(secret, f"{timestamp}." + body)>`
- `Idempotency-Key: <notice.idempotency_key>` (contract + period): the key billing deduplicates on

The timestamp is signed with the body so that a captured request cannot be replayed after the
receiver's tolerance; within it, the idempotency key makes a replay a recognisable duplicate.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass

from torchpass.contract.credit import CreditNotice
from torchpass.errors import ErrorType, TorchpassError

SIGNATURE_HEADER = "X-Torchpass-Signature"
TIMESTAMP_HEADER = "X-Torchpass-Timestamp"
IDEMPOTENCY_HEADER = "Idempotency-Key"
SIGNATURE_VERSION = "v1"
DEFAULT_SIGNAL_NAME = "yoco_credit"
DEFAULT_TOLERANCE_S = 300.0
MAX_REPLY_BYTES = 64 * 1024


class BillingError(TorchpassError):
    """Base of billing errors; the error type carries the retry decision to the activity."""

    error_type = ErrorType.BILLING_REJECTED


class TransientBillingError(BillingError):
    """Billing is down, slow or overloaded: retry, the idempotency key makes it safe."""

    error_type = ErrorType.BILLING_UNAVAILABLE


class PermanentBillingError(BillingError):
    """No retry can cure it (wrong secret, wrong URL, a notice billing refuses): an operator must
    act."""


class BillingNotConfigured(PermanentBillingError):
    error_type = ErrorType.BILLING_NOT_CONFIGURED


class SignatureRejected(PermanentBillingError):
    """A receiver refuses a request: bad or missing signature, or a timestamp outside the
    tolerance."""


def canonical_body(notice: CreditNotice) -> bytes:
    """The notice as deterministic bytes: the same notice always signs to the same signature."""
    # Decimal -> str, date -> ISO: no float ever carries money
    data = notice.model_dump(mode="json")
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode(
        "utf-8"
    )


def sign(body: bytes, timestamp: int, secret: str) -> str:
    """Hex HMAC-SHA256 over `f"{timestamp}."` followed by the body."""
    return hmac.new(
        secret.encode("utf-8"), f"{timestamp}.".encode() + body, hashlib.sha256
    ).hexdigest()


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
    """Raise SignatureRejected unless the body was signed with `secret` within `tolerance_s` of
    `now`."""
    lower = {k.lower(): v for k, v in headers.items()}
    raw_ts = lower.get(TIMESTAMP_HEADER.lower(), "")
    if not (raw_ts.isascii() and raw_ts.isdigit() and len(raw_ts) <= 12):
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
    """The v1 signatures of a header such as `v1=ab12,v1=cd34` (two while a secret is being
    rotated)."""
    prefix = f"{SIGNATURE_VERSION}="
    return [p.strip()[len(prefix) :] for p in header.split(",") if p.strip().startswith(prefix)]


@dataclass(frozen=True)
class HttpReply:
    """What billing answered: a status and the first MAX_REPLY_BYTES of the body."""

    status: int
    body: bytes


@dataclass(frozen=True)
class WebhookAck:
    status: int
    duplicate: bool


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
            f"billing webhook refused the signature (HTTP {reply.status}: {detail}); not retried: "
            "check that TORCHPASS_BILLING_WEBHOOK_SECRET matches the receiver's secret and that "
            "this host's clock is right"
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
