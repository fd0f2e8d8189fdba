"""Signed planned-migration claims: a drain or cordon that reaches a job through Temporal (a cluster
watch, an operator's tool) rather than over its authenticated control channel must carry an
HMAC-SHA256 of the evidence under the job's secret. Without it the claim is refused: anyone who can
start a workflow could otherwise move a healthy rank off its node."""

from __future__ import annotations

import hashlib
import hmac

from torchpass.models import Evidence

_LABEL = b"torchpass-planned-v1\0"


def planned_signature(secret: bytes, ev: Evidence) -> str:
    """The signature of `ev` (its every field but the signature itself) under the job's secret."""
    body = ev.model_copy(update={"signature": None}).model_dump_json().encode()
    return hmac.new(secret, _LABEL + body, hashlib.sha256).hexdigest()


def sign(secret: bytes, ev: Evidence) -> Evidence:
    return ev.model_copy(update={"signature": planned_signature(secret, ev)})


def is_signed(secret: bytes, ev: Evidence) -> bool:
    return ev.signature is not None and hmac.compare_digest(
        ev.signature, planned_signature(secret, ev)
    )
