"""`torchpass cost`: the brief's four costs per month, with and without live migration."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from datetime import UTC, datetime
from decimal import Decimal
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from torchpass.cli.common import CliError
from torchpass.cli.cost import register, run
from torchpass.contract.cost import (
    CostInputs,
    NoQualifyingOutcomes,
    inputs_from_ledger,
    inputs_from_outcomes,
    monthly_cost,
)
from torchpass.contract.entries import EntryStatus as ES
from torchpass.contract.entries import LedgerEntry
from torchpass.contract.queries import LedgerRow
from torchpass.incident.outcome import MigrationOutcome
from torchpass.models import Category, Classification, Disposition, FailureKind

# 730 h / 7.3 h = exactly 100 failures a month: every amount is a whole number of cents.
ROUND = CostInputs(mttf_hours=Decimal("7.3"))


def test_the_vendors_assumptions_cost_about_307k_a_month() -> None:
    # Per failure, 1,024 GPUs x $3/GPU-hour = $3,072 per job-hour: replace 10 min = 512, restart 5
    # min = 256, restore 5 min = 256, recompute 1.5 h / 2 = 2,304; 3,328 in all. 730 h / 7.9 h =
    # 7300/79 = 92.405... failures a month. Exactly: provisioning 3,737,600/79 = 47,311.392...,
    # restart and restore 1,868,800/79 = 23,655.696... each, recompute 16,819,200/79 =
    # 212,901.265...; total 24,294,400/79 = 307,524.0506... Rounded per line: 47,311.39 + 23,655.70
    # + 23,655.70 + 212,901.27 = 307,524.06.
    cost = monthly_cost(CostInputs())
    before = cost.without_migration
    assert cost.per_failure.amount == Decimal("3328.00")
    assert cost.failures_per_month == Decimal("92.4051")
    assert before.provisioning.amount == Decimal("47311.39")
    assert before.restarting.amount == before.restoring.amount == Decimal("23655.70")
    assert before.recomputing.amount == Decimal("212901.27")
    assert before.migrating.amount == 0
    assert before.total.amount == Decimal("307524.06")
    assert abs(before.total.amount - Decimal(24_294_400) / 79) < Decimal("0.02")
    assert Decimal(305_000) < before.total.amount < Decimal(310_000)
    assert before.total.currency == "USD"


def test_live_migration_at_the_defaults_leaves_a_tenth_of_the_failures_and_a_minute_each() -> None:
    # Migrated: 0.9 x 92.405 x 3,072 x 60/3600 = 4,258.03; fallen back: 0.1 x 307,524.05 in four
    # lines.
    cost = monthly_cost(CostInputs())
    after = cost.with_migration
    assert after.migrating.amount == Decimal("4258.03")
    assert after.recomputing.amount == Decimal("21290.13")
    assert after.total.amount == Decimal("35010.44")
    assert cost.savings.amount == Decimal("272513.62")


def test_every_line_doubles_with_the_gpus() -> None:
    one = monthly_cost(ROUND)
    two = monthly_cost(ROUND.model_copy(update={"gpus": 2 * ROUND.gpus}))
    assert one.without_migration.total.amount == Decimal("332800.00")
    for a, b in (
        (one.without_migration, two.without_migration),
        (one.with_migration, two.with_migration),
    ):
        for line in (
            "provisioning",
            "restarting",
            "restoring",
            "recomputing",
            "migrating",
            "total",
        ):
            assert getattr(b, line).amount == 2 * getattr(a, line).amount, line


def test_halving_the_mean_time_to_failure_doubles_the_failures_and_the_cost() -> None:
    half = monthly_cost(ROUND.model_copy(update={"mttf_hours": ROUND.mttf_hours / 2}))
    assert half.failures_per_month == 200
    assert half.without_migration.total.amount == Decimal("665600.00")


def test_recompute_grows_with_the_checkpoint_interval_and_the_rest_does_not() -> None:
    base = monthly_cost(ROUND).without_migration
    longer = monthly_cost(
        ROUND.model_copy(update={"checkpoint_interval_hours": Decimal(3)})
    ).without_migration
    assert longer.recomputing.amount == 2 * base.recomputing.amount
    assert longer.provisioning == base.provisioning
    assert longer.restarting == base.restarting
    assert longer.restoring == base.restoring


def test_every_failure_live_migrated_instantly_costs_nothing() -> None:
    cost = monthly_cost(CostInputs(success_rate=Decimal(1), migration_seconds=Decimal(0)))
    assert cost.with_migration.total.amount == 0
    assert cost.savings == cost.without_migration.total


def test_no_live_migration_costs_the_same_as_without() -> None:
    cost = monthly_cost(CostInputs(success_rate=Decimal(0)))
    assert cost.with_migration == cost.without_migration
    assert cost.savings.amount == 0


def test_amounts_carry_the_currency_of_the_price() -> None:
    cost = monthly_cost(ROUND.model_copy(update={"currency": "EUR"}))
    assert cost.savings.currency == cost.with_migration.migrating.currency == "EUR"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("gpus", 0, "greater than 0"),
        ("gpu_hour_price", Decimal(-1), "greater than or equal to 0"),
        ("mttf_hours", Decimal(0), "greater than 0"),
        ("checkpoint_interval_hours", Decimal(0), "greater than 0"),
        ("replace_minutes", Decimal(-5), "greater than or equal to 0"),
        ("restart_minutes", Decimal(-5), "greater than or equal to 0"),
        ("restore_minutes", Decimal(-5), "greater than or equal to 0"),
        ("migration_seconds", Decimal(-1), "greater than or equal to 0"),
        ("success_rate", Decimal("1.01"), "less than or equal to 1"),
        ("success_rate", Decimal("-0.1"), "greater than or equal to 0"),
        ("mttf_hours", Decimal("NaN"), "finite number"),
        ("currency", "dollars", "should match pattern"),
    ],
)
def test_bad_inputs_are_rejected_with_the_field_named(
    field: str, value: object, message: str
) -> None:
    with pytest.raises(ValidationError) as e:
        CostInputs(**{field: value})
    assert e.value.errors()[0]["loc"] == (field,)
    assert message in str(e.value)


def test_an_unknown_input_is_rejected() -> None:
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        CostInputs(gpu=8)  # type: ignore[call-arg]


@given(
    gpus=st.integers(1, 100_000),
    price=st.decimals(0, 100, places=2),
    mttf=st.decimals("0.1", 1000, places=2),
    interval=st.decimals("0.01", 24, places=2),
    minutes=st.tuples(*[st.decimals(0, 120, places=1)] * 3),
    rate=st.decimals(0, 1, places=3),
    data=st.data(),
)
def test_live_migration_never_costs_more_when_it_is_faster_than_a_restart(
    gpus: int,
    price: Decimal,
    mttf: Decimal,
    interval: Decimal,
    minutes: tuple[Decimal, Decimal, Decimal],
    rate: Decimal,
    data: st.DataObject,
) -> None:
    idle_seconds = sum(minutes, Decimal(0)) * 60
    migration = data.draw(st.decimals(0, idle_seconds, places=1))
    replace, restart, restore = minutes
    cost = monthly_cost(
        CostInputs(
            gpus=gpus,
            gpu_hour_price=price,
            mttf_hours=mttf,
            checkpoint_interval_hours=interval,
            replace_minutes=replace,
            restart_minutes=restart,
            restore_minutes=restore,
            migration_seconds=migration,
            success_rate=rate,
        )
    )
    # Exactly, with <= without; each of the 5 (4) lines is rounded to the cent on its own.
    assert cost.with_migration.total.amount <= cost.without_migration.total.amount + Decimal("0.05")
    assert cost.savings.amount >= Decimal("-0.05")


@given(rate=st.decimals(0, 1, places=4), seconds=st.decimals(0, 3600, places=1))
def test_the_total_is_the_sum_of_its_lines(rate: Decimal, seconds: Decimal) -> None:
    cost = monthly_cost(CostInputs(success_rate=rate, migration_seconds=seconds))
    for b in (cost.without_migration, cost.with_migration):
        lines = (b.provisioning, b.restarting, b.restoring, b.recomputing, b.migrating)
        assert b.total.amount == sum((m.amount for m in lines), Decimal(0))
    exact_without = Fraction(24_294_400, 79)
    assert abs(Fraction(cost.without_migration.total.amount) - exact_without) <= Fraction(2, 100)


# --- measured on real outcomes
# -------------------------------------------------------------------------

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def outcome(
    n: int,
    *,
    success: bool,
    seconds: float | None = None,
    category: Category = Category.HOST_GPU_FABRIC,
    disposition: Disposition | None = None,
) -> MigrationOutcome:
    qualifying = category in {Category.PLANNED, Category.INTERRUPTION, Category.HOST_GPU_FABRIC}
    return MigrationOutcome(
        incident_id=f"incident-{n}",
        job_id="job",
        failure_domain=f"node-{n}",
        kind=FailureKind.GPU_FELL_OFF_BUS,
        evidence_count=1,
        classification=Classification(category=category, qualifying=qualifying, reason="r"),
        covered=True,
        disposition=disposition
        or (Disposition.MIGRATED if success else Disposition.FALLBACK_RESTART),
        success=success,
        detected_at=T0,
        recovery_seconds=seconds,
    )


def test_outcomes_give_the_success_rate_and_the_median_migration_time() -> None:
    outcomes = [
        outcome(1, success=True, seconds=1.59),
        outcome(2, success=True, seconds=2.71),
        outcome(3, success=True, seconds=1.74),
        outcome(4, success=False, seconds=15.11),  # a restart's time is not a migration's
        outcome(5, success=False, category=Category.SHARED_INFRASTRUCTURE),  # not counted
        outcome(6, success=False, disposition=Disposition.NOT_A_FAILURE),  # a false alarm
    ]
    measured = inputs_from_outcomes(CostInputs(), outcomes)
    assert measured.success_rate == Decimal("0.75")
    assert measured.migration_seconds == Decimal("1.74")
    assert measured.gpus == 1024
    assert measured.mttf_hours == Decimal("7.9")


def test_an_even_count_of_migrations_takes_the_mean_of_the_middle_two() -> None:
    outcomes = [outcome(n, success=True, seconds=s) for n, s in enumerate((1.0, 2.0, 3.0, 10.0))]
    assert inputs_from_outcomes(CostInputs(), outcomes).migration_seconds == Decimal("2.5")


def test_without_a_timed_migration_the_assumed_time_stays() -> None:
    base = CostInputs(migration_seconds=Decimal(42))
    measured = inputs_from_outcomes(base, [outcome(1, success=True), outcome(2, success=False)])
    assert measured.success_rate == Decimal("0.5")
    assert measured.migration_seconds == Decimal(42)


def test_nothing_qualifying_is_nothing_to_measure() -> None:
    with pytest.raises(NoQualifyingOutcomes, match="no qualifying failures"):
        inputs_from_outcomes(
            CostInputs(), [outcome(1, success=False, category=Category.UNABLE_TO_RECOVER)]
        )


def row(n: int, status: ES, seconds: float | None = None) -> LedgerRow:
    return LedgerRow.of(LedgerEntry(f"inc-{n}", "job-a", T0, status, recovery_seconds=seconds))


def test_the_ledger_alone_gives_the_success_rate_and_the_median_migration_time() -> None:
    rows = [
        row(1, ES.SUCCESS, 1.59),
        row(2, ES.SUCCESS, 2.71),
        row(3, ES.SUCCESS, 1.74),
        row(4, ES.FAILURE, 15.11),  # a restart's time is not a migration's
        row(5, ES.SHARED_INFRASTRUCTURE),  # not counted
        row(6, ES.NOT_A_FAILURE),  # a false alarm
        row(7, ES.NOT_OPTED_IN, 0.5),  # not covered: not counted, unlike in inputs_from_outcomes
    ]
    measured = inputs_from_ledger(CostInputs(), rows)
    assert measured.success_rate == Decimal("0.75")
    assert measured.migration_seconds == Decimal("1.74")
    assert measured.gpus == 1024


def test_the_ledger_without_timed_migrations_keeps_the_assumed_time() -> None:
    base = CostInputs(migration_seconds=Decimal(42))
    measured = inputs_from_ledger(base, [row(1, ES.SUCCESS), row(2, ES.FAILURE)])
    assert (measured.success_rate, measured.migration_seconds) == (Decimal("0.5"), Decimal(42))
    with pytest.raises(NoQualifyingOutcomes, match="no qualifying failures"):
        inputs_from_ledger(
            CostInputs(), [row(1, ES.UNABLE_TO_RECOVER), row(2, ES.AWAITING_VALIDATION)]
        )


# --- the command
# ---------------------------------------------------------------------------------------


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="torchpass")
    register(p.add_subparsers(dest="command", required=True))
    return p.parse_args(["cost", *argv])


def test_the_command_prints_the_four_costs_and_the_savings(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert run(parse()) == 0
    out = capsys.readouterr().out
    for text in (
        "provisioning replacement",
        "restarting the job",
        "restoring from checkpoint",
        "recomputing since checkpoint",
        "307,524.06",
        "35,010.44",
        "272,513.62",
        "(88.6%)",
        "month = 730 h",
        "92.41 failures/month",
        "3,328.00 USD per failure",
    ):
        assert text in out, text


def test_the_command_answers_json_with_the_inputs_given(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse(
        "--gpus",
        "2048",
        "--gpu-hour-usd",
        "2.5",
        "--mttf-hours",
        "7.3",
        "--success-rate",
        "1",
        "--json",
    )
    assert run(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["inputs"]["gpus"] == 2048
    assert Decimal(doc["inputs"]["gpu_hour_price"]) == Decimal("2.5")
    # 2,048 x 2.5 = 5,120 per job-hour; 20 min + 0.75 h = 1.0833 h of it; 100 failures.
    assert Decimal(doc["without_migration"]["total"]["amount"]) == Decimal("554666.67")
    assert Decimal(doc["with_migration"]["restarting"]["amount"]) == 0
    assert doc["savings"]["currency"] == "USD"


def test_the_command_rejects_a_bad_input_with_a_validation_error() -> None:
    with pytest.raises(ValidationError, match="success_rate"):
        run(parse("--success-rate", "1.5"))


def test_the_command_rejects_a_word_for_a_number(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parse("--mttf-hours", "often")
    assert e.value.code == 2
    assert "not a number: 'often'" in capsys.readouterr().err


def test_a_contract_needs_a_lookup_wired() -> None:
    with pytest.raises(CliError, match="contract lookup needs"):
        run(parse("--contract", "c-1"))


def test_a_contract_uses_its_real_outcomes(capsys: pytest.CaptureFixture[str]) -> None:
    asked: list[str] = []

    async def lookup(contract_id: str) -> Sequence[LedgerRow]:
        asked.append(contract_id)
        return [row(1, ES.SUCCESS, 2.0), row(2, ES.FAILURE, 15.0)]

    assert run(parse("--contract", "c-1", "--json"), ledger_for_contract=lookup) == 0
    doc = json.loads(capsys.readouterr().out)
    assert asked == ["c-1"]
    assert Decimal(doc["inputs"]["success_rate"]) == Decimal("0.5")
    assert Decimal(doc["inputs"]["migration_seconds"]) == Decimal("2.0")


def test_a_contract_with_nothing_recorded_is_a_clear_error() -> None:
    async def lookup(contract_id: str) -> Sequence[LedgerRow]:
        return []

    with pytest.raises(CliError, match="contract 'c-1': no qualifying failures"):
        run(parse("--contract", "c-1"), ledger_for_contract=lookup)


def test_a_contract_and_an_assumed_success_rate_do_not_mix() -> None:
    async def lookup(contract_id: str) -> Sequence[LedgerRow]:
        raise AssertionError("not asked")

    with pytest.raises(CliError, match="--contract measures --success-rate"):
        run(parse("--contract", "c-1", "--success-rate", "0.5"), ledger_for_contract=lookup)
