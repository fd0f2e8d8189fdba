"""Every size is bounded at the edge: an amount no evaluation can overflow, ids and errors that
always fit a contract's history. Each case was found breaking a contract or an incident on an
unbounded main."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

import pytest
from pydantic import ValidationError

from torchpass.cli import main
from torchpass.contract.credit import MAX_AMOUNT, Money
from torchpass.incident.outcome import MAX_ERROR, MigrationOutcome, bounded_error
from torchpass.models import Category, Classification, Disposition, FailureKind

QUALIFYING = Classification(category=Category.INTERRUPTION, qualifying=True, reason="r")


def outcome(**kw: object) -> MigrationOutcome:
    fields: dict[str, object] = {
        "incident_id": "torchpass-incident:j:n:g0/run",
        "job_id": "j",
        "failure_domain": "n",
        "kind": FailureKind.PROCESS_EXIT,
        "evidence_count": 1,
        "classification": QUALIFYING,
        "covered": True,
        "disposition": Disposition.MIGRATED,
        "success": True,
        "detected_at": datetime(2026, 12, 1, tzinfo=UTC),
        **kw,
    }
    return MigrationOutcome.model_validate(fields)


def test_an_absurd_amount_is_refused_with_its_field_named() -> None:
    for bad in ("1e30", "-1e16", "0.0000001"):
        with pytest.raises(ValidationError, match="amount"):
            Money(amount=Decimal(bad), currency="USD")
    fee = Money(amount=MAX_AMOUNT, currency="USD")
    # the credit of the largest fee computes
    assert fee.times(Decimal("0.25")).amount == MAX_AMOUNT / 4


def test_contract_create_refuses_a_fee_no_evaluation_could_compute(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["contract", "create", "--customer", "a", "--contract", "c", "--start", "2027-01-01"]
    assert main([*argv, "--fee", "1e30", "--address", "127.0.0.1:1"]) == 2
    assert "amount: Value error, amount must be at most" in capsys.readouterr().err


def test_an_outcome_with_a_megabyte_id_is_refused() -> None:
    with pytest.raises(ValidationError, match="incident_id"):
        outcome(incident_id="x" * 1_400_000)
    with pytest.raises(ValidationError, match="job_id"):
        outcome(job_id="j" * 201)


def test_a_long_error_keeps_its_start_and_end_within_the_bound() -> None:
    text = "first cause; " + "x" * 50_000 + "; last cause"
    kept = bounded_error(text)
    assert kept is not None and len(kept) <= MAX_ERROR
    assert kept.startswith("first cause") and kept.endswith("last cause")
    assert outcome(error=kept).error == kept
