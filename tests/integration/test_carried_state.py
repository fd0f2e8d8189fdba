"""State a script carries from step to step on each rank (`examples/train_carried.py`: a GRU trained
by truncated back-propagation, its hidden state going on from batch to batch as in PyTorch's
word_language_model, or the next batch drawn ahead of its step), declared with `agent.carry`. No
replica holds a rank's carried state, so the process that takes a killed rank's slot starts it
afresh: the state moved is bitwise the donor's, yet the run ends elsewhere than the run that never
failed. The incident must say so: migrated, but not live, with why (before, such runs were reported
"migrated, success, 0 steps recomputed" and ended with other weights)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from temporalio.client import Client

from job_agent import wire
from job_agent.coordinator.jobs import request, wait_until_ready
from tests.integration.conftest import ROOT, run_with, spec, start_job
from torchpass.models import Disposition

pytestmark = pytest.mark.integration
SCRIPT = ROOT / "examples" / "train_carried.py"
STATUS = wire.StatusRequest()


@pytest.mark.parametrize(("mode", "name"), [((), "hidden"), (("--prefetch",), "batch")])
async def test_a_rank_that_carried_state_migrates_and_the_incident_says_it_is_not_live(
    client: Client, tmp_path: Path, mode: tuple[str, ...], name: str
) -> None:
    args = ("--steps", "60", *mode)
    job = spec(tmp_path / "run", f"carried-{name}", script=SCRIPT, args=args)
    result = await run_with(client, job, [("kill", 1, 20)])
    reference = await run_with(
        client, spec(tmp_path / "ref", f"carried-{name}-ref", spares=0, script=SCRIPT, args=args)
    )
    assert result.ok and reference.ok, (result.error, reference.error)
    (o,) = result.incidents
    assert o.disposition is Disposition.MIGRATED and o.proof is not None
    assert o.proof.donor_digest in o.proof.receiver_digests.values()  # the moved state is exact
    assert not o.success, o  # ... and yet not live
    assert o.error and "no replica holds" in o.error and f"({name})" in o.error, o.error
    # what the incident says is borne out: the run ended elsewhere than the one that never failed
    assert result.final_digest != reference.final_digest


async def _reference(client: Client, tmp_path: Path, name: str, args: tuple[str, ...]) -> str:
    ref = await run_with(
        client, spec(tmp_path / "ref", f"{name}-ref", spares=0, script=SCRIPT, args=args)
    )
    assert ref.ok and ref.final_digest, ref.error
    return ref.final_digest


@pytest.mark.parametrize(
    ("mode", "sign"),
    [
        ((), "carried state from step to step that the agent was not told of"),
        (("--prefetch",), "did step 20 again from other inputs to its model"),
    ],
)
async def test_undeclared_carried_state_is_caught_and_the_kill_is_not_live(
    client: Client, tmp_path: Path, mode: tuple[str, ...], sign: str
) -> None:
    """The same script written without torchpass in mind (`--undeclared`): the hidden state is
    seen fed back to the model the step after it returned it (so the rank whose process was
    replaced lost it); the batch drawn ahead, by the survivors doing step 20 again with the batch
    their failed try drew."""
    args = ("--steps", "60", "--undeclared", *mode)
    name = f"undeclared{'-'.join(mode)}"
    result = await run_with(
        client, spec(tmp_path / "run", name, script=SCRIPT, args=args), [("kill", 1, 20)]
    )
    assert result.ok, result.error
    (o,) = result.incidents
    assert o.disposition is Disposition.MIGRATED and not o.success, o
    assert o.error and sign in o.error and "agent.carry" in o.error, o.error
    assert result.final_digest != await _reference(client, tmp_path, name, args)


async def test_undeclared_hidden_state_of_a_drained_rank_is_caught(
    client: Client, tmp_path: Path
) -> None:
    """A planned move redoes no step: the hidden state seen fed back, before the drain, is what
    says the drained rank's replacement started it afresh."""
    args = ("--steps", "200", "--undeclared")
    job = spec(tmp_path / "run", "undeclared-drain", script=SCRIPT, args=args)
    task = await start_job(client, job)
    try:
        await asyncio.to_thread(wait_until_ready, job.state_dir, job.job_id)
        while True:  # the state is seen fed back from step 1 on
            status = await asyncio.to_thread(request, job.state_dir, job.job_id, STATUS)
            if isinstance(status, wire.Status) and min(r.step for r in status.ranks) >= 5:
                break
            await asyncio.sleep(0.05)
        reply = await asyncio.to_thread(request, job.state_dir, job.job_id, wire.Drain(slot=1))
        assert isinstance(reply, wire.Ok), reply
        result = await asyncio.wait_for(asyncio.shield(task), 150)
    finally:
        if not task.done():
            task.cancel()
    assert result.ok, result.error
    (o,) = result.incidents
    assert o.disposition is Disposition.MIGRATED and not o.success, o
    assert o.error and "rank(s) [1] carried state" in o.error, o.error
    assert result.final_digest != await _reference(client, tmp_path, "undeclared-drain", args)
