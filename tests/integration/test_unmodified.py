"""An unmodified torchrun script (`examples/torchrun_ddp.py`, no torchpass import) under `torchpass
run --no-agent`: torchrun's environment, a real rank SIGKILLed, the failure an incident with its
workflow, classified "not configured for live migration" (disqualifying: never counted, live or
not), and the whole job restarted from the script's own checkpoint, the restart count and the steps
recomputed (measured from the optimizer's own step count) in the result."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from temporalio.client import Client

from job_agent import wire
from job_agent.coordinator.jobs import request
from tests.integration.conftest import ROOT, run_with, spec, start_job
from torchpass.incident.classify import NO_AGENT_REASON
from torchpass.models import Category, Disposition

pytestmark = pytest.mark.integration

SCRIPT = ROOT / "examples" / "torchrun_ddp.py"


@pytest.mark.parametrize("save", ["path", "file", "dcp", "dcp-async"])
async def test_a_kill_restarts_the_whole_job_from_the_scripts_checkpoint_and_is_recorded(
    client: Client, tmp_path: Path, save: str
) -> None:
    """The script's checkpoint saved by rank 0 with `torch.save` to a path or to a file it opened,
    or by every rank with `torch.distributed.checkpoint.save` (seen once the script imports it) or
    its `async_save` (counted once its upload completed): each is found, and the restart's
    recomputed steps measured from it."""
    ckpt = str(tmp_path / "ckpt.pt")
    args = ("--steps", "40", "--width", "64", "--ckpt", ckpt, "--ckpt-every", "5", "--save", save)
    # The default hang timeout (10 s), not the tests' 1.5 s: on a loaded 2-core machine a rank
    # saving the last checkpoint could miss heartbeats that long, a hang this test is not about.
    job = spec(
        tmp_path,
        f"unmodified-kill-{save}",
        spares=0,
        script=SCRIPT,
        args=args,
        agent=False,
        hang_timeout=10.0,
    )
    result = await run_with(client, job, [("kill", 2, 17)])
    assert result.ok, result.error
    assert result.steps_completed == 40 and result.restarts == 1
    [o] = result.incidents
    assert o.disposition is Disposition.FALLBACK_RESTART and not o.success
    assert (
        o.classification.category is Category.UNABLE_TO_RECOVER and not o.classification.qualifying
    )
    assert NO_AGENT_REASON in o.classification.reason
    assert o.fallback is not None and o.fallback.restored_step in (14, 19)  # the script's last save
    # The kill lands as rank 2 enters step 17 (so the job had completed 16, perhaps 17): the steps
    # from the checkpoint's up to there ran twice, as the restarted ranks' optimizers counted them.
    fb = o.fallback
    assert (
        fb.failed_at_step in (16, 17) and o.steps_recomputed == fb.failed_at_step - fb.restored_step
    ), o


async def test_max_restarts_bounds_the_restarts(client: Client, tmp_path: Path) -> None:
    """With --max-restarts 0 the first failure ends the job, recorded, instead of restarting it."""
    args = ("--steps", "40", "--width", "64", "--ckpt", str(tmp_path / "ckpt.pt"))
    job = spec(
        tmp_path,
        "unmodified-bounded",
        spares=0,
        script=SCRIPT,
        args=args,
        agent=False,
        max_restarts=0,
    )
    result = await run_with(client, job, [("kill", 1, 8)])
    assert not result.ok and result.restarts == 0
    assert result.error and "--max-restarts" in result.error


NO_OPTIMIZER = """
import sys, time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
w = torch.zeros(4)
for k in range(int(sys.argv[1])):
    g = torch.ones(4) * (dist.get_rank() + 1)
    dist.all_reduce(g)
    w -= 0.01 * g  # its own update: no torch.optim optimizer to count steps by
    time.sleep(0.05)
dist.destroy_process_group()
"""


async def test_a_script_without_an_optimizer_is_restarted_and_its_incident_ends(
    client: Client, tmp_path: Path
) -> None:
    """No step is ever seen of a script that updates its weights by hand. A kill restarts the job
    once, and the incident ends when the restarted ranks have joined (before, the recovery waited
    120 s for a step report that never came, then restarted the healthy job a second time, and
    the incident showed running for minutes before it failed)."""
    script = tmp_path / "no_optimizer.py"
    script.write_text(NO_OPTIMIZER)
    job = spec(
        tmp_path, "no-optimizer", spares=0, script=script, args=("400",), agent=False, nproc=2
    )
    task = await start_job(client, job)
    await asyncio.sleep(1.5)  # it trains
    kill = wire.Inject(action=wire.InjectAction.KILL, slot=1)
    assert isinstance(await asyncio.to_thread(request, job.state_dir, job.job_id, kill), wire.Ok)
    result = await asyncio.wait_for(task, 90)
    assert result.ok, result.error
    assert result.restarts == 1
    [o] = result.incidents
    assert o.disposition is Disposition.FALLBACK_RESTART and o.fallback is not None
    # training again once the restarted ranks joined: not when they finished, 20 s later
    assert o.recovery_seconds is not None and o.recovery_seconds < 10, o
