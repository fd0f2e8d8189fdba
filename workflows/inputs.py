"""A workflow's inputs, decoded by the workflow itself. A malformed start input fails the workflow
with a typed error naming the field, instead of failing its every workflow task forever (which is
what the SDK does with an input it cannot decode) and leaving it open, holding its id; a malformed
update or query argument is refused with the same typed error, naming the field."""

from __future__ import annotations

from typing import TypeVar

from temporalio import workflow
from temporalio.common import RawValue
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from torchpass.errors import ErrorType

M = TypeVar("M")


def decode_start(raw: RawValue, model: type[M]) -> M:
    return decode(raw, model, "start input")


def decode(raw: RawValue, model: type[M], what: str) -> M:
    """`raw` as `model`, or a non-retryable `InvalidInput` naming what and which fields are wrong
    (the SDK's own decoding would say only "Failed decoding arguments")."""
    try:
        value = workflow.payload_converter().from_payload(raw.payload, model)
    except Exception as e:  # any payload that is not the model: refused, typed
        raise _invalid(what, model, str(e)) from None
    if not isinstance(value, model):  # a null payload decodes to None whatever the type asked
        raise _invalid(what, model, f"got {type(value).__name__}")
    return value


def _invalid(what: str, model: type, why: str) -> ApplicationError:
    return ApplicationError(
        f"malformed {what}, not a {model.__name__}: {why}"[:4000],
        type=ErrorType.INVALID_INPUT.value,
        non_retryable=True,
    )
