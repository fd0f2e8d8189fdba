"""Money and the credit notice: what the contract workflow sends to billing.

Shared by the contract rules (`torchpass.contract.rules`), the contract workflow and the billing
activities, so that the notice a billing system receives has one definition. Money is a `Decimal`
with an ISO 4217 currency; floats never carry an amount.
"""

from __future__ import annotations

from datetime import date
from decimal import Decimal

from pydantic import AwareDatetime, Field, NonNegativeInt, field_validator

from torchpass.models import Model

MAX_AMOUNT = Decimal("1e15")
"""No license fee, credit or cost comes near a quadrillion; past it, Decimal arithmetic at its
default 28-digit precision would fail (InvalidOperation) deep inside a contract's evaluation."""
MAX_PLACES = 6


class Money(Model):
    """An amount in one currency. Arithmetic across currencies is an error, never a silent mix."""

    amount: Decimal = Field(description="exact decimal amount, e.g. Decimal('125000.00')")
    currency: str = Field(pattern=r"^[A-Z]{3}$", description="ISO 4217 code, e.g. 'USD'")

    @field_validator("amount")
    @classmethod
    def _finite(cls, v: Decimal) -> Decimal:
        if not v.is_finite():
            raise ValueError("amount must be a finite decimal")
        if abs(v) > MAX_AMOUNT:
            raise ValueError(f"amount must be at most {MAX_AMOUNT:,.0f} in size, got {v:.3e}")
        exponent = v.as_tuple().exponent
        if isinstance(exponent, int) and exponent < -MAX_PLACES:
            raise ValueError(f"amount must have at most {MAX_PLACES} decimal places, got {v}")
        return v

    def _same(self, other: Money) -> None:
        if other.currency != self.currency:
            raise ValueError(f"currency mismatch: {self.currency} vs {other.currency}")

    def __add__(self, other: Money) -> Money:
        self._same(other)
        return Money(amount=self.amount + other.amount, currency=self.currency)

    def __sub__(self, other: Money) -> Money:
        self._same(other)
        return Money(amount=self.amount - other.amount, currency=self.currency)

    def times(self, factor: Decimal) -> Money:
        """This amount times an exact factor, rounded half-even to the cent."""
        return Money(
            amount=(self.amount * factor).quantize(Decimal("0.01")), currency=self.currency
        )

    def __str__(self) -> str:
        return f"{self.amount:,.2f} {self.currency}"


def credit_idempotency_key(contract_id: str, period_end: date) -> str:
    """The one key of a credit: contract + evaluated period. A billing system deduplicates on it."""
    return f"yoco-credit:{contract_id}:{period_end.isoformat()}"


class CreditNotice(Model):
    """A YOCO credit owed to a customer, sent to billing exactly once per contract and period."""

    idempotency_key: str = Field(
        min_length=1, description="contract + period; see credit_idempotency_key"
    )
    contract_id: str = Field(min_length=1)
    customer_id: str = Field(min_length=1)
    period_start: date = Field(description="first day of the trailing window that was measured")
    period_end: date = Field(description="the evaluation date (renewal or expansion), exclusive")
    trigger: str = Field(description="'renewal' or 'expansion'")
    success_rate: Decimal = Field(ge=0, le=1, description="successful / total qualifying, exact")
    qualifying: NonNegativeInt
    successful: NonNegativeInt
    amount: Money = Field(description="25% of the annual license fee")
    apply_to: str = Field(description="what the credit applies to: the next renewal or expansion")
    issued_at: AwareDatetime


class CreditDelivery(Model):
    """What billing answered for one notice."""

    idempotency_key: str
    webhook_status: int | None = Field(
        default=None, description="HTTP status of the accepting attempt"
    )
    duplicate: bool = Field(default=False, description="billing had already accepted this key")
    billing_workflow_signalled: bool = False
    delivered_at: AwareDatetime
