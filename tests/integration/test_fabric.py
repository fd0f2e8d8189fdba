"""Lightning Fabric under the agent (`examples/train_fabric.py`, `AgentEnvironment`): Fabric's DDP,
optimizer and distributed data loader, the agent's loop form. A kill and a hang are migrated live,
bitwise the run that never failed."""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.client import Client

from tests.integration.conftest import ROOT, run_with, spec

pytestmark = pytest.mark.integration
SCRIPT = ROOT / "examples" / "train_fabric.py"
ARGS = ("--steps", "40")


async def test_a_kill_and_a_hang_under_fabric_are_migrated_live_and_bitwise(
    client: Client, tmp_path: Path
) -> None:
    ref = await run_with(
        client, spec(tmp_path / "ref", "fabric-ref", spares=0, script=SCRIPT, args=ARGS, nproc=2)
    )
    assert ref.ok and ref.final_digest and not ref.incidents, ref.error
    job = spec(tmp_path / "run", "fabric", script=SCRIPT, args=ARGS, nproc=2)
    result = await run_with(client, job, [("kill", 1, 10), ("hang", 0, 25)])
    assert result.ok, result.error
    assert len(result.incidents) == 2 and all(o.success for o in result.incidents), result.incidents
    assert result.final_digest == ref.final_digest
