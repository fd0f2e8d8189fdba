"""Waits that are not hangs, with real ranks: rank 0 evaluating alone while its peers wait at the
next collective (`agent.busy`), and a spare whose first step is slow (a cold start). Each check is
shown failing without what makes it pass: the same waits undeclared are taken for hangs."""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.client import Client

from tests.integration.conftest import run_with, spec
from torchpass.models import FailureKind

pytestmark = pytest.mark.integration

SCRIPT = """
import argparse, time
import torch
from job_agent import RankAgent

p = argparse.ArgumentParser()
p.add_argument("--eval-every", type=int, default=0)
p.add_argument("--eval-seconds", type=float, default=0.0)
p.add_argument("--undeclared", action="store_true")
p.add_argument("--first-step-seconds", type=float, default=0.0)
args = p.parse_args()

agent = RankAgent()
joined_as_spare = agent.is_spare
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
agent.track(model, opt)
first = [True]


def step(k):
    if first[0] and joined_as_spare:
        time.sleep(args.first_step_seconds)  # a cold start: compilation, caches
    first[0] = False
    opt.zero_grad()
    model(torch.randn(4, 8)).sum().backward()
    agent.all_reduce_gradients()
    opt.step()
    time.sleep(0.05)  # a step's own work: the job trains long enough to be watched
    if args.eval_every and agent.rank == 0 and k % args.eval_every == args.eval_every - 1:
        if args.undeclared:
            time.sleep(args.eval_seconds)
        else:
            with agent.busy("evaluation"):
                time.sleep(args.eval_seconds)


agent.run(step, steps=40)
"""


def _job(tmp_path: Path, name: str, *args: str) -> object:
    script = tmp_path / "waits.py"
    script.write_text(SCRIPT)
    return spec(
        tmp_path, name, script=script, args=args, nproc=3, hang_timeout=1.0, collective_timeout=30.0
    )


@pytest.mark.parametrize("declared", [True, False], ids=["busy", "undeclared"])
async def test_rank_0_evaluating_alone_is_not_a_hang_when_it_says_so(
    client: Client, tmp_path: Path, declared: bool
) -> None:
    args = ("--eval-every", "15", "--eval-seconds", "2.5", *(() if declared else ("--undeclared",)))
    job = _job(tmp_path, f"eval-{declared}", *args)
    result = await run_with(client, job)  # type: ignore[arg-type]
    if declared:
        assert result.ok and not result.incidents, (result.error, result.incidents)
    else:  # the check can fail: the same evaluation, unannounced, is taken for a hang of rank 0
        assert any(o.kind is FailureKind.HANG and o.lost_slots == (0,) for o in result.incidents), (
            result
        )


async def test_a_spare_slow_in_its_first_step_is_not_taken_for_hung(
    client: Client, tmp_path: Path
) -> None:
    """Rank 2 killed at step 10; the spare that takes its slot spends 3 s in its first step (three
    hang timeouts) while its peers wait in the collective: one incident, migrated live, not a second
    one for the spare (before, the spare was fenced as hung and the next one took its place)."""
    job = _job(tmp_path, "cold-spare", "--first-step-seconds", "3")
    result = await run_with(client, job, [("kill", 2, 10)])  # type: ignore[arg-type]
    assert result.ok, result.error
    assert [o.lost_slots for o in result.incidents] == [(2,)], result.incidents
    assert result.incidents[0].success and result.steps_recomputed == 0
