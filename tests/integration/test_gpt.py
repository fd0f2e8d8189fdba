"""A nanoGPT-shaped trainer (`examples/train_gpt.py`: stock DDP, AdamW with two parameter groups, a
warm-up + cosine `LambdaLR`, bfloat16 autocast, a `GradScaler`, gradient clipping, dropout and
random batch windows from torch's RNG) under a real kill and a real hang: both migrated live,
nothing recomputed, the final state (model, optimizer, scheduler and scaler) bitwise equal to the
same run never failed."""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.client import Client

from tests.integration.conftest import ROOT, run_with, spec
from tests.integration.test_live_migration import assert_migrated_live

pytestmark = pytest.mark.integration

GPT = ROOT / "examples" / "train_gpt.py"
ARGS = ("--steps", "40")


async def test_a_gpt_with_amp_survives_a_kill_and_a_hang_bitwise(
    client: Client, tmp_path: Path
) -> None:
    reference = await run_with(
        client, spec(tmp_path / "ref", "gpt-ref", spares=0, script=GPT, args=ARGS)
    )
    assert reference.ok and reference.final_digest and not reference.incidents, reference.error
    job = spec(tmp_path / "run", "gpt-kill-hang", script=GPT, args=ARGS)
    result = await run_with(client, job, [("kill", 1, 12), ("hang", 3, 27)])
    assert_migrated_live(result, reference, 2)
    other = spec(
        tmp_path / "other", "gpt-other", spares=0, script=GPT, args=(*ARGS, "--dropout", "0.2")
    )
    different = await run_with(client, other)
    # the comparison can fail
    assert different.ok and different.final_digest != reference.final_digest
