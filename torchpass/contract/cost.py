"""What failures cost a cluster each month, with and without live migration: `torchpass cost`.

The brief's four costs of every failure, for a job that spans the whole cluster:

* provisioning a replacement, restarting the job, restoring the last checkpoint: the whole job's
  GPUs sit idle (and paid for) for replace + restart + restore minutes;
* recomputing the work lost since that checkpoint: on average half a checkpoint interval on every
  GPU, because a failure is equally likely to strike anywhere in the interval.

A month is 730 hours (365 * 24 / 12) and the job fails every `mttf_hours` (the mean time to failure
of the whole job, not of one GPU). With live migration a fraction `success_rate` of the failures
idles the job only for `migration_seconds` and recomputes nothing; the rest fall back to the four
costs.

Pure: no I/O. Arithmetic is exact (`Fraction`); each amount is rounded half-even to the cent once,
at the end, and a total is the sum of its rounded lines so that a table adds up.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from decimal import Decimal
from fractions import Fraction

from pydantic import Field, PositiveInt

from torchpass.contract.credit import Money
from torchpass.contract.entries import EntryStatus
from torchpass.contract.queries import LedgerRow
from torchpass.incident.outcome import MigrationOutcome
from torchpass.models import Disposition, Model

HOURS_PER_MONTH = Decimal(730)  # 365 days * 24 h / 12 months


class CostInputs(Model):
    """A cluster and its failure profile. The defaults are the vendor's published assumptions."""

    gpus: PositiveInt = Field(
        default=1024, description="GPUs of the job, all idle while it recovers"
    )
    gpu_hour_price: Decimal = Field(default=Decimal(3), ge=0, description="price of one GPU-hour")
    currency: str = Field(
        default="USD", pattern=r"^[A-Z]{3}$", description="ISO 4217 code of the price"
    )
    mttf_hours: Decimal = Field(
        default=Decimal("7.9"), gt=0, description="mean time to failure of the job"
    )
    checkpoint_interval_hours: Decimal = Field(default=Decimal("1.5"), gt=0)
    replace_minutes: Decimal = Field(
        default=Decimal(10), ge=0, description="provision a replacement node"
    )
    restart_minutes: Decimal = Field(default=Decimal(5), ge=0, description="restart the job")
    restore_minutes: Decimal = Field(
        default=Decimal(5), ge=0, description="load the last checkpoint"
    )
    migration_seconds: Decimal = Field(
        default=Decimal(60), ge=0, description="whole-job pause of one live migration"
    )
    success_rate: Decimal = Field(
        default=Decimal("0.9"),
        ge=0,
        le=1,
        description="share of failures resolved by live migration",
    )


class CostBreakdown(Model):
    """One month of failures, line by line; `total` is the sum of the rounded lines."""

    provisioning: Money = Field(description="whole job idle while a replacement is provisioned")
    restarting: Money = Field(description="whole job idle while it restarts")
    restoring: Money = Field(description="whole job idle while it loads the last checkpoint")
    recomputing: Money = Field(description="work since the last checkpoint, done again")
    migrating: Money = Field(description="whole job paused while ranks live-migrate")
    total: Money


class MonthlyCost(Model):
    """`monthly_cost`'s answer: the four costs without TorchPass, the same month with it, the
    savings."""

    inputs: CostInputs
    hours_per_month: Decimal
    failures_per_month: Decimal = Field(description="hours_per_month / mttf_hours, to 4 places")
    per_failure: Money = Field(description="the four costs of one failure")
    without_migration: CostBreakdown
    with_migration: CostBreakdown
    savings: Money = Field(description="without_migration.total - with_migration.total")


def _money(amount: Fraction, currency: str) -> Money:
    # round() of a Fraction is exact and half-even, so no intermediate Decimal precision is
    # involved.
    cents = round(amount * 100)
    return Money(amount=Decimal(cents).scaleb(-2), currency=currency)


def _breakdown(lines: dict[str, Fraction], currency: str) -> CostBreakdown:
    money = {name: _money(value, currency) for name, value in lines.items()}
    total = sum((m.amount for m in money.values()), Decimal("0.00"))
    return CostBreakdown(**money, total=Money(amount=total, currency=currency))


def monthly_cost(inputs: CostInputs) -> MonthlyCost:
    """The brief's four costs per month for `inputs`, beside the cost with live migration."""
    job_hour = inputs.gpus * Fraction(inputs.gpu_hour_price)  # the whole job for one hour
    failures = Fraction(HOURS_PER_MONTH) / Fraction(inputs.mttf_hours)
    per_failure = {
        "provisioning": job_hour * Fraction(inputs.replace_minutes) / 60,
        "restarting": job_hour * Fraction(inputs.restart_minutes) / 60,
        "restoring": job_hour * Fraction(inputs.restore_minutes) / 60,
        "recomputing": job_hour * Fraction(inputs.checkpoint_interval_hours) / 2,
    }
    migrated = Fraction(inputs.success_rate)
    fallen_back = 1 - migrated
    without = {name: failures * cost for name, cost in per_failure.items()}
    with_ = {name: fallen_back * cost for name, cost in without.items()}
    without["migrating"] = Fraction(0)
    with_["migrating"] = failures * migrated * job_hour * Fraction(inputs.migration_seconds) / 3600
    cur = inputs.currency
    before, after = _breakdown(without, cur), _breakdown(with_, cur)
    return MonthlyCost(
        inputs=inputs,
        hours_per_month=HOURS_PER_MONTH,
        failures_per_month=(Decimal(failures.numerator) / Decimal(failures.denominator)).quantize(
            Decimal("0.0001")
        ),
        per_failure=_money(sum(per_failure.values(), Fraction(0)), cur),
        without_migration=before,
        with_migration=after,
        savings=before.total - after.total,
    )


class NoQualifyingOutcomes(ValueError):
    """There is nothing to measure: no qualifying failure has been recorded."""


def _seconds(value: float) -> Decimal:
    # str() keeps the value as recorded (1.74), where Decimal(float) would spell out its binary
    # expansion.
    return Decimal(str(value))


def inputs_from_outcomes(base: CostInputs, outcomes: Iterable[MigrationOutcome]) -> CostInputs:
    """`base` with the success rate and migration time measured from real outcomes.

    Counted as the brief measures the guarantee: success rate = successful qualifying / qualifying.
    Migration time is the median `recovery_seconds` of the successful ones (failure observed ->
    training again). False alarms (`not_a_failure`) cost nothing and are left out. Where no
    successful migration recorded a recovery time, `base.migration_seconds` stays.
    """
    counted = [
        o
        for o in outcomes
        if o.classification.qualifying and o.disposition != Disposition.NOT_A_FAILURE
    ]
    if not counted:
        raise NoQualifyingOutcomes(
            "no qualifying failures recorded: nothing to measure the cost from"
        )
    successful = [o for o in counted if o.success]
    return _measured(base, len(counted), [o.recovery_seconds for o in successful])


def inputs_from_ledger(base: CostInputs, rows: Iterable[LedgerRow]) -> CostInputs:
    """`base` measured from a contract's ledger alone, as `inputs_from_outcomes` from outcomes.

    Only counted rows (covered, qualifying, real failures: what the contract's rate counts) are
    used; a row is successful when its status is `success`, and its `recovery_seconds` is the one
    the ledger kept (to the millisecond). The caller chooses the rows: `torchpass cost --contract`
    passes the current trailing window's (`torchpass.cli.contract.contract_ledger_rows`)."""
    counted = [r for r in rows if r.counted]
    if not counted:
        raise NoQualifyingOutcomes(
            "no qualifying failures recorded: nothing to measure the cost from"
        )
    successful = [r for r in counted if r.status is EntryStatus.SUCCESS]
    return _measured(base, len(counted), [r.recovery_seconds for r in successful])


def _measured(base: CostInputs, counted: int, successful_times: list[float | None]) -> CostInputs:
    """The success rate of `counted` failures of which len(successful_times) live-migrated, and the
    median of the recovery times they recorded (where none did, `base.migration_seconds` stays)."""
    rate = Decimal(len(successful_times)) / Decimal(counted)
    update: dict[str, Decimal] = {"success_rate": rate}
    times = [_seconds(t) for t in successful_times if t is not None]
    if times:
        update["migration_seconds"] = statistics.median(times)
    # Validate again: model_copy(update=...) alone would skip the field checks.
    return CostInputs.model_validate({**base.model_dump(), **update})
