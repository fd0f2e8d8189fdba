"""Chaos, CI-sized: one real job (4 ranks, 3 warm spares, real processes and gloo) and 30 failures
injected at random but reproducibly (`bench.chaos.plan`, seeded), one at a time: ranks SIGKILLed,
stopped as a hang stops them, paused past the hang timeout, drained (a planned move of a healthy
rank), two killed at the same step, spares killed (one still starting up when there is one), and
killed with a second process (the donor, the receiving spare, another rank) killed during that
recovery's transfer or as its group re-forms. Every failure of a rank must be migrated live, no
completed step recomputed, one incident each (none lost, none doubled; a spare's loss makes none),
each incident once in its contract's ledger, and the final state bitwise equal to the same run never
failed."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import pytest
from temporalio.client import Client

from bench.chaos import (
    MIX,
    SECOND,
    SPARES,
    incidents_of,
    ledger_rows,
    open_contract,
    plan,
    run,
    steps_for,
)
from tests.integration.conftest import run_with, spec

FAILURES = 30
SEED = 20261206


# A reference run and 30 recoveries, 10 of them with a second loss: about 70 s alone on 2 cores; its
# own bound, past the suite's 180 s default, for a busy machine.
@pytest.mark.timeout(600)
async def test_thirty_random_failures_are_all_migrated_live_and_bitwise_exact(
    client: Client, tmp_path: Path
) -> None:
    args = ("--steps", str(steps_for(FAILURES)), "--width", "128", "--depth", "2")
    injections = plan(FAILURES, SEED)  # the plan the 1,000-failure benchmark uses
    kinds = Counter(a for a, _, _ in injections)
    assert {a for a, _ in MIX} <= kinds.keys(), kinds  # the seed draws every kind at least once
    reference = await run_with(
        client, spec(tmp_path / "ref", "chaos-ref", spares=0, args=args), timeout=300
    )
    contract = await open_contract(client, "chaos")
    job = spec(tmp_path / "run", "chaos", spares=SPARES, args=args, contract=contract)
    result = await asyncio.wait_for(run(client, job, injections), 900)
    ledger = await ledger_rows(client, contract, result)

    outcomes = result.incidents
    dispositions = Counter(o.disposition.value for o in outcomes)
    replanned = sum(bool(o.proof and o.proof.replans) for o in outcomes)
    summary = (
        f"injected {FAILURES} ({kinds}), incidents {len(outcomes)}, {dispositions}, re-planned "
        f"{replanned}, steps recomputed {result.steps_recomputed}, ledger rows {len(ledger)}"
    )
    print(summary)
    assert result.ok, (summary, result.error)
    expected = incidents_of(injections)  # one per failure, but a spare's loss makes none
    assert len(outcomes) == expected, summary  # none lost, none doubled
    assert [o.success for o in outcomes] == [True] * expected, summary
    two = sum(len(o.lost_slots) == 2 for o in outcomes)
    assert two >= kinds["double"], summary  # two ranks killed at once: one incident, both slots
    # Each second loss made its recovery re-plan (the transfer-time kills), and is on its record.
    assert replanned >= sum(kinds[a] for a in SECOND), summary
    assert result.steps_recomputed == 0 and sum(o.steps_recomputed for o in outcomes) == 0, summary
    assert reference.final_digest and result.final_digest == reference.final_digest, summary
    # The record reached the ledger once each: the contract's verified rows are exactly the
    # incidents.
    assert sorted(r.incident_id for r in ledger) == sorted(o.incident_id for o in outcomes), summary
    assert all(r.duplicates == 0 for r in ledger), summary
