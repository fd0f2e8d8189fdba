"""Lightning Fabric under the agent (`examples/train_fabric.py`, `LiveFabricStrategy`): Fabric's
DDP, optimizer and distributed data loader, the agent's loop form. Once the spare is warm (its
device is its own, past the ranks': Fabric's list of devices does not hold it, and a spare that
crashed on it once passed this test by luck), a kill and then a hang are migrated live, bitwise the
run that never failed."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from temporalio.client import Client

from job_agent import wire
from job_agent.coordinator.jobs import request, wait_until_ready
from tests.integration.conftest import ROOT, run_with, spec, start_job

pytestmark = pytest.mark.integration
SCRIPT = ROOT / "examples" / "train_fabric.py"
ARGS = ("--steps", "400")


async def test_a_kill_and_a_hang_under_fabric_are_migrated_live_and_bitwise(
    client: Client, tmp_path: Path
) -> None:
    ref = await run_with(
        client, spec(tmp_path / "ref", "fabric-ref", spares=0, script=SCRIPT, args=ARGS, nproc=2)
    )
    assert ref.ok and ref.final_digest and not ref.incidents, ref.error
    job = spec(tmp_path / "run", "fabric", script=SCRIPT, args=ARGS, nproc=2)
    task = await start_job(client, job)
    try:
        ready = await asyncio.to_thread(wait_until_ready, job.state_dir, job.job_id)
        at = max(r.step for r in ready.ranks) + 5
        for action, slot, step in (("kill", 1, at), ("hang", 0, at + 60)):
            inject = wire.Inject(action=wire.InjectAction(action), slot=slot, after_step=step)
            assert isinstance(
                await asyncio.to_thread(request, job.state_dir, job.job_id, inject), wire.Ok
            )
        result = await asyncio.wait_for(asyncio.shield(task), 150)
    finally:
        if not task.done():
            task.cancel()
    assert result.ok, result.error
    assert len(result.incidents) == 2 and all(o.success for o in result.incidents), result.incidents
    assert result.final_digest == ref.final_digest
