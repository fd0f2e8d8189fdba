"""GPU health starting incidents on a real multi-node job: each node agent reads its GPUs through
the real `nvidia-ml-py` bindings, here against the fake `libnvidia-ml.so.1` of `tests/nvml` (no GPU
exists on these machines; the fake stands for the driver's NVML, driven by a state file per node,
which the test writes as a GPU would change). Everything else is real: `torchpass node` processes,
torch.distributed ranks, the incidents MigrationWorkflows on the real dev server.

A temperature ramp on one GPU moves the rank on it off pre-emptively (a planned migration: it
freezes with the others at a step boundary, then leaves, and a spare takes its slot); an XID 79
(fallen off the bus) on another kills the rank on it and is a GPU failure, its state from a replica.
Both live, bitwise equal to the job never failed, nothing recomputed.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from temporalio.client import Client

from tests import nvml
from tests.integration.conftest import LONG_ARGS, spec, start_job
from tests.integration.test_multinode import (  # noqa: F401 (fixtures)
    coordinator_of,
    hosts,
    log_of,
    node_argv,
    status,
)
from torchpass.dev.hosts import Fabric
from torchpass.job import JobResult
from torchpass.models import Category, Disposition, FailureKind

ARGS = LONG_ARGS


async def test_a_hot_gpu_moves_its_rank_off_before_it_fails_and_a_gpu_off_the_bus_is_a_failure(
    client: Client,
    tmp_path: Path,
    hosts: Fabric,  # noqa: F811
    long_reference: JobResult,
) -> None:
    lib = nvml.build(tmp_path)
    job = spec(tmp_path, "gpu-signals", args=ARGS, nodes=2, host=hosts.coordinator)
    task = await start_job(client, job)
    address = await coordinator_of(job)
    states = {}
    for h in hosts.hosts:
        states[h.name] = tmp_path / f"nvml-{h.name}"
        states[h.name].write_text(
            "gpus 8\n" + "".join(f"temp {i} 60\necc {i} 0\n" for i in range(8))
        )
        env = ["env", f"LD_LIBRARY_PATH={lib.parent}", f"FAKE_NVML_STATE={states[h.name]}"]
        argv = [*env, *node_argv(job, address, h, slots=2, spares=1, args=ARGS)]
        hosts.start(h, argv, str(tmp_path / f"{h.name}.log"))
    before = await status(job)
    while len(before.ranks) < 4 or before.state != "training" or before.spares < 2:
        assert not task.done(), (await task).error
        await asyncio.sleep(0.05)
        before = await status(job)
    node = {r.slot: r.node for r in before.ranks}
    # Which GPU a rank uses is its LOCAL_RANK, which its node gave it as it started it: the rank
    # says it in its hello, and the job's status shows it. 8 GPUs a node: no two of its processes
    # share one.
    gpu = {r.slot: r.device for r in before.ranks}
    assert all(d >= 0 for d in gpu.values()), before
    hot_node, hot_gpu = node[3], gpu[3]
    off_node, off_gpu = node[0], gpu[0]
    for celsius in (75, 80, 84, 88):  # a ramp: the move starts at the threshold (85), once
        with states[hot_node].open("a") as f:
            f.write(f"temp {hot_gpu} {celsius}\n")
        # the scenario: the GPU warms over time, its node reads whichever it reads
        await asyncio.sleep(0.3)
    after = await status(job)
    while after.incidents < 1 or after.state != "training" or len(after.ranks) < 4:
        assert not task.done(), (await task).error
        await asyncio.sleep(0.05)
        after = await status(job)
    with states[off_node].open("a") as f:
        f.write(f"xid 1 {off_gpu} 79\n")
    result = await asyncio.wait_for(task, 180)

    assert result.ok, (result.error, log_of(tmp_path, hot_node), log_of(tmp_path, off_node))
    planned, failed = result.incidents
    assert planned.disposition is Disposition.MIGRATED and planned.success, planned
    assert planned.classification.category is Category.PLANNED and planned.lost_slots == (3,), (
        planned
    )
    assert planned.failure_domain == hot_node
    assert planned.proof is not None and planned.proof.receiver_slots == (3,), planned.proof
    assert failed.disposition is Disposition.MIGRATED and failed.success, failed
    assert failed.classification.category is Category.HOST_GPU_FABRIC and failed.lost_slots == (
        0,
    ), failed
    assert failed.kind is FailureKind.GPU_FELL_OFF_BUS, failed
    # Rank 0's slot takes the state from a replica; a rank still short of the frozen step (the XID
    # came right after the first recovery) takes it too, rather than recompute it.
    assert failed.proof is not None and 0 in failed.proof.receiver_slots, failed.proof
    assert result.steps_recomputed == 0
    assert result.final_digest == long_reference.final_digest
