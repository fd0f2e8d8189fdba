"""Stock `DistributedDataParallel` under real failures (`examples/train_ddp.py`): the model wrapped
as usual, a default `DistributedSampler`, a cosine schedule and gradient accumulation with
`no_sync()`. Real ranks killed and hung, each migrated live (the wrapper moved onto the re-formed
group, the spare's fresh wrapper on the same bucket layout as its peers), and the final state
bitwise equal to the same script never failed."""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.client import Client

from tests.integration.conftest import ROOT, run_with, spec
from tests.integration.test_live_migration import assert_migrated_live
from torchpass.job import JobResult, JobState

pytestmark = pytest.mark.integration

DDP_SCRIPT = ROOT / "examples" / "train_ddp.py"
# 2,048 samples over 4 ranks in batches of 32: 16 steps an epoch; buckets of 50 kB, so the 3 x
# 128-wide layers reduce in several buckets.
ARGS = ("--steps", "50", "--width", "128", "--depth", "3")


@pytest.fixture(scope="module")
async def ddp_reference(client: Client, tmp_path_factory: pytest.TempPathFactory) -> JobResult:
    job = spec(
        tmp_path_factory.mktemp("ddp-ref"), "ddp-reference", spares=0, script=DDP_SCRIPT, args=ARGS
    )
    result = await run_with(client, job)
    assert result.ok and result.final_digest and not result.incidents, result.error
    return result


async def test_stock_ddp_survives_a_kill_and_a_hang_live_and_bitwise_exact(
    client: Client, ddp_reference: JobResult, tmp_path: Path
) -> None:
    job = spec(tmp_path, "ddp-kill-hang", script=DDP_SCRIPT, args=ARGS)
    result = await run_with(client, job, [("kill", 3, 17), ("hang", 1, 33)])
    assert_migrated_live(result, ddp_reference, 2)
    assert [o.lost_slots for o in result.incidents] == [(3,), (1,)]


async def test_other_accumulation_is_not_bitwise_equal(
    client: Client, ddp_reference: JobResult, tmp_path: Path
) -> None:
    """The comparison above can fail: the same script in 4 micro-batches instead of 2 ends with
    other bits."""
    job = spec(tmp_path, "ddp-other", spares=0, script=DDP_SCRIPT, args=(*ARGS, "--accum", "4"))
    result = await run_with(client, job)
    assert result.ok and result.final_digest != ddp_reference.final_digest


LOCAL_BUFFERS = ROOT / "tests" / "integration" / "ddp_local_buffers.py"


async def test_batchnorm_statistics_are_rank_0s_at_every_step_boundary_so_rank_0_can_be_lost(
    client: Client, tmp_path: Path
) -> None:
    """A BatchNorm's running statistics change in the forward, before the collective, and DDP gives
    every rank rank 0's only at the next forward. The agent rewinds them when a step is done again
    and gives every rank rank 0's as each step ends, so losing rank 0 itself is still bitwise
    exact."""
    args = ("--broadcast-buffers",)
    ref = spec(tmp_path / "ref", "ddp-bn-ref", spares=0, script=LOCAL_BUFFERS, args=args)
    reference = await run_with(client, ref)
    assert reference.ok and reference.final_digest, reference.error
    job = spec(tmp_path / "kill", "ddp-bn-kill", script=LOCAL_BUFFERS, args=args)
    result = await run_with(client, job, [("kill", 0, 9), ("kill", 2, 20)])
    assert_migrated_live(result, reference, 2)


async def test_rank_0_lost_after_its_optimizer_step_is_not_applied_twice(
    client: Client, tmp_path: Path
) -> None:
    """Rank 0 dies right after its optimizer's step of step 12, the survivors having stepped too.
    The agent gives every rank rank 0's buffers before the optimizer steps, not as the step ends:
    had that broadcast come after (as it once did), the survivors' step would fail in it with their
    weights already updated, and doing the step again would apply its update twice, every replica
    alike, so no digest check could see it. The survivors finish step 12; the spare takes it from
    them; bitwise equal."""
    args = ("--broadcast-buffers",)
    ref = spec(tmp_path / "ref", "ddp-opt-ref", spares=0, script=LOCAL_BUFFERS, args=args)
    reference = await run_with(client, ref)
    assert reference.ok and reference.final_digest, reference.error
    job = spec(
        tmp_path / "kill",
        "ddp-opt-kill",
        script=LOCAL_BUFFERS,
        args=(*args, "--die-after-step", "12"),
    )
    result = await run_with(client, job)
    assert_migrated_live(result, reference, 1)
    (o,) = result.incidents
    assert o.lost_slots == (0,) and o.proof is not None and o.proof.step_before == 12, o


async def test_gradients_cleared_as_the_step_ends_do_not_leak_into_a_step_done_again(
    client: Client, tmp_path: Path
) -> None:
    """nanoGPT clears its gradients at the end of a step, not before the backward. A step that
    failed in its backward leaves gradients behind: the step done again would add to them. The agent
    puts them back as the step began (none, or zeros), so a kill and a hang are still bitwise
    exact."""
    args = ("--broadcast-buffers", "--zero-grad-last")
    ref = spec(tmp_path / "ref", "ddp-zg-ref", spares=1, script=LOCAL_BUFFERS, args=args)
    reference = await run_with(client, ref)
    assert reference.ok and reference.final_digest, reference.error
    job = spec(tmp_path / "kill", "ddp-zg-kill", spares=2, script=LOCAL_BUFFERS, args=args)
    result = await run_with(client, job, [("kill", 1, 9), ("hang", 2, 20)])
    assert_migrated_live(result, reference, 2)


async def test_a_peer_lost_in_a_collective_after_the_optimizer_step_ends_the_job_naming_it(
    client: Client, tmp_path: Path
) -> None:
    """The script all-reduces its loss for logging after `opt.step()`, and rank 0 dies between the
    two: the survivors' step fails with its update applied. Doing it again would apply it twice,
    silently and on every replica alike, so the job ends instead, naming the step and the rule (the
    step's collectives before the optimizer's step)."""
    args = ("--broadcast-buffers", "--log-loss", "--die-after-step", "12")
    job = spec(tmp_path, "ddp-log-after-step", script=LOCAL_BUFFERS, args=args)
    result = await run_with(client, job, timeout=90)
    assert result.status is JobState.USER_ERROR and result.error, result.error
    assert "step 12 failed after optimizer.step()" in result.error, result.error
    assert "before optimizer.step()" in result.error, result.error


async def test_ddp_keeping_each_ranks_buffers_is_refused_at_track(
    client: Client, tmp_path: Path
) -> None:
    """`broadcast_buffers=False` with a BatchNorm leaves every replica its own statistics, which no
    spare could take over: `track()` refuses it with the reason, and the job fails at once, naming
    it."""
    job = spec(tmp_path, "ddp-local-buffers", spares=0, script=LOCAL_BUFFERS, args=())
    result = await run_with(client, job, timeout=60)
    assert result.status is JobState.USER_ERROR and result.error, result.error
    assert "before training" in result.error and "broadcast_buffers=False" in result.error, (
        result.error
    )


async def test_batchnorm_without_ddp_is_refused_at_track(client: Client, tmp_path: Path) -> None:
    """The same BatchNorm model reduced by `agent.all_reduce_gradients()`, no DDP: nothing makes the
    ranks' statistics agree, so the replicas would differ from the first step (each replica check an
    incident): refused before training, naming the module and the fixes."""
    job = spec(tmp_path, "bn-no-ddp", spares=0, script=LOCAL_BUFFERS, args=("--no-ddp",))
    result = await run_with(client, job, timeout=60)
    assert result.status is JobState.USER_ERROR and result.error, result.error
    assert (
        "1 (BatchNorm1d) keeps running statistics" in result.error
        and "SyncBatchNorm" in result.error
    )


async def test_torch_compile_over_ddp_survives_a_kill_and_a_hang_live_and_bitwise(
    client: Client, tmp_path: Path
) -> None:
    """`torch.compile(DDP(model))` (inductor on the CPU here): the agent finds the DDP wrapper
    inside the compiled module, a spare compiles on its first step (a cold start, never taken for
    hung) and the redone step runs the same compiled code, so the result is bitwise the compiled
    script's, never failed. The compiled script's bits are its own: compared against the compiled
    run, not the eager one."""
    # Dynamo's DDP support needs buckets of at least DDP's first bucket (1 MB): 4 x 256-wide layers
    # in two.
    args = ("--steps", "30", "--width", "256", "--depth", "4", "--bucket-mb", "1", "--compile")
    reference = await run_with(
        client, spec(tmp_path / "ref", "ddp-compile-ref", spares=0, script=DDP_SCRIPT, args=args)
    )
    assert reference.ok and reference.final_digest and not reference.incidents, reference.error
    eager = await run_with(
        client, spec(tmp_path / "eager", "ddp-eager", spares=0, script=DDP_SCRIPT, args=args[:-1])
    )
    # inductor's kernels: other bits
    assert eager.ok and eager.final_digest != reference.final_digest
    job = spec(tmp_path / "kill", "ddp-compile-kill", script=DDP_SCRIPT, args=args)
    result = await run_with(client, job, [("kill", 2, 9), ("hang", 0, 20)])
    assert_migrated_live(result, reference, 2)


NOISE = (*ARGS, "--steps", "30", "--noise", "0.1")


async def test_the_scripts_own_random_streams_are_tracked_and_seeded(
    client: Client, tmp_path: Path
) -> None:
    """Input noise drawn from a `torch.Generator` the script keeps (tracked as an extra: its
    position moves with the state) and a flip drawn from Python's `random` (seeded by the agent each
    step): a kill and a hang, live and bitwise. Left untracked, the generator restarts on the spare
    and the result is other bits, the same on every replica: no replica check sees it, but the
    survivors doing step 8 again draw other noise than their first try did, so the incident says it
    is not live (it once said "success")."""
    ref = spec(tmp_path / "ref", "ddp-noise-ref", spares=0, script=DDP_SCRIPT, args=NOISE)
    reference = await run_with(client, ref)
    assert reference.ok and reference.final_digest and not reference.incidents, reference.error
    job = spec(tmp_path / "kill", "ddp-noise-kill", script=DDP_SCRIPT, args=NOISE)
    assert_migrated_live(
        await run_with(client, job, [("kill", 1, 8), ("hang", 3, 19)]), reference, 2
    )
    args = (*NOISE, "--noise-untracked")
    untracked = spec(tmp_path / "untracked", "ddp-noise-untracked", script=DDP_SCRIPT, args=args)
    result = await run_with(client, untracked, [("kill", 1, 8)])
    assert result.ok, result.error
    (o,) = result.incidents
    assert not o.success and o.error and "did step 8 again from other inputs" in o.error, o
    assert result.final_digest != reference.final_digest


async def test_a_stateless_comm_hook_survives_a_kill_live_and_bitwise(
    client: Client, tmp_path: Path
) -> None:
    """`register_comm_hook(None, fp16_compress_hook)`: the hook reduces over the default group,
    which the agent re-forms, and stays registered on the wrapper moved onto it; the hook changes
    the bits (its reduction is in float16), so a wrapper that lost it would not match the
    reference."""
    args = (*ARGS, "--steps", "30", "--comm-hook", "fp16")
    reference = await run_with(
        client, spec(tmp_path / "ref", "ddp-hook-ref", spares=0, script=DDP_SCRIPT, args=args)
    )
    assert reference.ok and reference.final_digest and not reference.incidents, reference.error
    plain = await run_with(
        client,
        spec(tmp_path / "plain", "ddp-hook-plain", spares=0, script=DDP_SCRIPT, args=args[:-2]),
    )
    assert plain.ok and plain.final_digest != reference.final_digest
    job = spec(tmp_path / "kill", "ddp-hook-kill", script=DDP_SCRIPT, args=args)
    assert_migrated_live(
        await run_with(client, job, [("kill", 2, 9), ("hang", 0, 20)]), reference, 2
    )


async def test_a_comm_hook_with_state_is_refused_at_track(client: Client, tmp_path: Path) -> None:
    """PowerSGD's hook keeps its process group and each rank's error feedback in its state: nothing
    a re-formed group or a spare could take over, so `track()` refuses it with the fix."""
    job = spec(
        tmp_path,
        "ddp-powersgd",
        spares=0,
        script=DDP_SCRIPT,
        args=(*ARGS, "--comm-hook", "powersgd"),
    )
    result = await run_with(client, job, timeout=60)
    assert result.status is JobState.USER_ERROR and result.error, result.error
    assert "before training" in result.error and "register a stateless hook" in result.error, (
        result.error
    )
