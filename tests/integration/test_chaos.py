"""Chaos, CI-sized: one real job (4 ranks, 2 warm spares, real processes and gloo) and 30 failures
injected at random but reproducibly (`bench.chaos.plan`, seeded): ranks SIGKILLed or stopped as a hang
stops them, one at a time, spaced in steps. Every one must be migrated live, no completed step
recomputed, one incident each, and the final state bitwise equal to the same run never failed."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from temporalio.client import Client

from bench.chaos import plan, steps_for
from tests.integration.conftest import run_with, spec

FAILURES = 30
SEED = 20261203


async def test_thirty_random_failures_are_all_migrated_live_and_bitwise_exact(
    client: Client, tmp_path: Path
) -> None:
    args = ("--steps", str(steps_for(FAILURES)), "--width", "128", "--depth", "2")
    injections = plan(FAILURES, SEED)  # the plan the 1,000-failure benchmark uses
    reference = await run_with(client, spec(tmp_path / "ref", "chaos-ref", spares=0, args=args), timeout=300)
    job = spec(tmp_path / "run", "chaos", spares=2, args=args)
    result = await run_with(client, job, injections, timeout=900)

    outcomes = result.incidents
    dispositions = Counter(o.disposition.value for o in outcomes)
    summary = (
        f"injected {FAILURES} ({Counter(a for a, _, _ in injections)}), incidents {len(outcomes)}, "
        f"{dispositions}, steps recomputed {result.steps_recomputed}"
    )
    print(summary)
    assert result.ok, (summary, result.error)
    assert len(outcomes) == FAILURES, summary  # one incident per failure: none lost, none doubled
    assert [o.success for o in outcomes] == [True] * FAILURES, summary
    assert result.steps_recomputed == 0 and sum(o.steps_recomputed for o in outcomes) == 0, summary
    assert reference.final_digest and result.final_digest == reference.final_digest, summary
