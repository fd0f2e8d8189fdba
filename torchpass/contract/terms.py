"""What a YOCO contract is created and changed with: its terms and purpose, the inputs of its
updates (opt-in, expansion, renewal), and the error that refuses one.

Contract dates (start, renewal, expansion) are calendar `date`s read as 00:00 UTC of that day;
events (an incident's detection, an opt-in, a validation) are timezone-aware datetimes. A window
``[a, b)`` of dates therefore holds the events detected from 00:00 UTC on ``a`` up to, not
including, 00:00 UTC on ``b``.
"""

from __future__ import annotations

from datetime import date
from enum import StrEnum

from pydantic import Field, model_validator

from torchpass.contract.credit import Money
from torchpass.errors import ErrorType, TorchpassError
from torchpass.models import Model

_ID = r"^[A-Za-z0-9._:-]+$"


class ContractRuleError(TorchpassError, ValueError):
    """An input the contract rules refuse; `error_type` (a `Contract*` ErrorType) says which
    rule."""

    def __init__(self, error_type: ErrorType, message: str) -> None:
        super().__init__(message, error_type)


class ContractPurpose(StrEnum):
    """A customer contract is the guarantee; a development one (demos, tests) accepts waived
    validation checks and never issues a credit notice to billing (docs/contract.md)."""

    CUSTOMER = "customer"
    DEVELOPMENT = "development"


DEVELOPMENT_BANNER = (
    "DEVELOPMENT contract: waivers accepted; not a customer guarantee; no credit to billing"
)


class ContractTerms(Model):
    """What a contract is created with (ContractWorkflow's start input, with `ContractInput`)."""

    customer_id: str = Field(min_length=1, max_length=200, pattern=_ID)
    contract_id: str = Field(min_length=1, max_length=200, pattern=_ID)
    start: date = Field(description="first day of the contract (00:00 UTC)")
    renewal_date: date = Field(description="end of the first term: the first evaluation at renewal")
    annual_fee: Money
    purpose: ContractPurpose = Field(
        default=ContractPurpose.CUSTOMER,
        description="development: a validation with waived checks covers a job, and no credit is "
        "issued",
    )
    continue_as_new_after: int = Field(
        default=2000,
        ge=5,
        le=50_000,
        description="history events handled before a run continues-as-new",
    )
    enrolment_key: str | None = Field(
        default=None,
        pattern=r"^[0-9a-f]{64}$",
        description="the public half of the cluster's enrolment key (Ed25519, hex): a validation "
        "registers a job's key only vouched for by it (torchpass.incident.attestation); none: any "
        "job that answers a validation on the control queue",
    )
    renewal_grace_days: int = Field(
        default=60,
        ge=0,
        le=366,
        description="days after a renewal date a late `renew` is still accepted (starting the next "
        "term from that date); the contract lapses when they pass without one. 0: lapse at the "
        "renewal",
    )

    @model_validator(mode="after")
    def _sane(self) -> ContractTerms:
        if self.annual_fee.amount <= 0:
            raise ValueError("annual_fee must be positive")
        if self.renewal_date <= self.start:
            raise ValueError("renewal_date must be after start")
        return self


class OptInInput(Model):
    job_id: str = Field(min_length=1, max_length=200)


class ExpandInput(Model):
    """An expansion purchased on `on`; `annual_fee` is the whole annual fee from then on.

    The fee is not constrained here on purpose: the workflow's validator answers a bad one with a
    typed `ContractInvalidFee`, which a caller can act on."""

    on: date
    annual_fee: Money


class RenewInput(Model):
    """The customer renews at the coming renewal date; fee and next renewal default to the same
    terms."""

    annual_fee: Money | None = None
    next_renewal: date | None = None
