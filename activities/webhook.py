"""The billing webhook's HTTP client: every billing HTTP call goes through `http_post`.

Blocking (urllib): the `deliver_credit` activity runs it in a thread. What the body, the signature
and billing's answers mean is pure and lives in `torchpass.contract.billing`.
"""

from __future__ import annotations

import functools
import http.client
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping

from activities.billing_settings import BillingSettings
from torchpass.contract.billing import (
    MAX_REPLY_BYTES,
    BillingNotConfigured,
    HttpReply,
    TransientBillingError,
    WebhookAck,
    canonical_body,
    interpret,
    signed_headers,
)
from torchpass.contract.credit import CreditNotice


@functools.cache
def _opener() -> urllib.request.OpenerDirector:
    class NoRedirect(urllib.request.HTTPRedirectHandler):
        # A redirected POST would be replayed as a GET without its body: the URL must be the final
        # one.
        def redirect_request(self, *args: object, **kwargs: object) -> None:
            return None

    return urllib.request.build_opener(NoRedirect)


def http_post(url: str, body: bytes, headers: Mapping[str, str], timeout: float) -> HttpReply:
    """POST once, bounded by `timeout`; an HTTP status is an answer, no answer is a transient
    error."""
    req = urllib.request.Request(url, data=body, headers=dict(headers), method="POST")
    try:
        with _opener().open(req, timeout=timeout) as resp:
            return HttpReply(resp.status, resp.read(MAX_REPLY_BYTES))
    except urllib.error.HTTPError as e:  # a status outside 2xx: an answer, read by interpret()
        with e:
            return HttpReply(e.code, e.read(MAX_REPLY_BYTES))
    # refused, reset, DNS, timeout: no answer at all
    except (OSError, http.client.HTTPException) as e:
        reason = e.reason if isinstance(e, urllib.error.URLError) else e
        raise TransientBillingError(
            f"billing webhook {redacted(url)} unreachable: {reason!r}"
        ) from None


def redacted(url: str) -> str:
    """The URL without its query, fragment or user info: a token in any of them never reaches an
    error (which Temporal keeps in the workflow's history)."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def send_webhook(
    settings: BillingSettings, notice: CreditNotice, now: float | None = None
) -> WebhookAck:
    """POST one signed notice once; raise a BillingError unless billing acknowledged it."""
    if settings.webhook_url is None or settings.webhook_secret is None:
        raise BillingNotConfigured("no billing webhook configured (TORCHPASS_BILLING_WEBHOOK_URL)")
    body = canonical_body(notice)
    headers = signed_headers(notice, body, settings.webhook_secret.get_secret_value(), now)
    return interpret(http_post(str(settings.webhook_url), body, headers, settings.timeout))
