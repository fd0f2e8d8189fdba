"""The brief's shared-infrastructure rows from what the node agents see of their hosts, on a real
multi-node job: "filesystem full" and "not enough memory" are disqualifying, recorded with their
reason, and the job falls back to a restart from its checkpoint; the same kill without them would be
a live migration (`test_multinode`).

The filesystem is real: a 1 MiB tmpfs mounted for the test (root is needed to mount it; the
project's CI machine has it, elsewhere the test is skipped saying so), watched by one node agent and
filled for real. The host's memory counters are the one stand-in: an OOM kill cannot be caused
safely on a shared machine, so the other node agent reads /proc/meminfo and /proc/vmstat from a
directory the test writes in their format (`--proc`), and the test counts an OOM kill there as it
SIGKILLs a rank, as the kernel would. Everything else is real: `torchpass node` processes,
torch.distributed ranks, real SIGKILLs, the incidents MigrationWorkflows on the real dev server.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from temporalio.client import Client

from job_agent import wire
from job_agent.coordinator.jobs import request
from tests.integration.conftest import LONG_ARGS, kill, spec, start_job
from tests.integration.test_multinode import (  # noqa: F401 (fixtures)
    coordinator_of,
    hosts,
    log_of,
    node_argv,
    status,
)
from tests.unit.job_driver import until
from tests.unit.test_host_health import fake_proc, tmpfs  # noqa: F401 (a fixture)
from torchpass.dev.hosts import Fabric
from torchpass.job import JobResult, JobSpec
from torchpass.models import Category, Disposition, FailureKind


async def test_a_rank_lost_while_its_filesystem_is_full_or_its_host_out_of_memory_is_disqualified(
    client: Client,
    tmp_path: Path,
    tmpfs: Path,  # noqa: F811
    hosts: Fabric,  # noqa: F811
    long_reference: JobResult,
) -> None:
    job = spec(tmp_path, "host-conditions", args=LONG_ARGS, nodes=2, host=hosts.coordinator)
    task = await start_job(client, job)
    address = await coordinator_of(job)
    disk_node, memory_node = (h.name for h in hosts.hosts)
    proc = fake_proc(tmp_path, oom_kills=5)
    watch = {
        disk_node: ["--watch-path", str(tmpfs), "--min-free-disk", str(256 << 10)],
        memory_node: ["--proc", str(proc)],
    }
    for h in hosts.hosts:
        base = node_argv(job, address, h, slots=2, spares=1, args=LONG_ARGS)
        at = base.index("--slots")
        argv = [*base[:at], "--host-check-every", "0.2", *watch[h.name], *base[at:]]
        hosts.start(h, argv, str(tmp_path / f"{h.name}.log"))
    before = await training(job, task, incidents=0, spares=2)

    # The checkpoint filesystem fills up (a real ENOSPC), then a rank on that node dies.
    fd = os.open(tmpfs / "step-40.pt", os.O_WRONLY | os.O_CREAT)
    with pytest.raises(OSError, match="No space left"):
        while True:
            os.write(fd, b"\0" * 65536)
    os.close(fd)
    # The node's next reading (every 0.2 s) says so: it logs what it tells the coordinator as it
    # tells it.
    await until(
        lambda: "bytes free of" in log_of(tmp_path, disk_node), "the node to find its disk full", 30
    )
    on_disk_node = next(r.slot for r in before.ranks if r.node == disk_node)
    inject = wire.Inject(action=wire.InjectAction.KILL, slot=on_disk_node)
    assert isinstance(await asyncio.to_thread(request, job.state_dir, job.job_id, inject), wire.Ok)
    after = await training(job, task, incidents=1)

    # Room again; then the host's OOM killer takes a rank of the other node.
    (tmpfs / "step-40.pt").unlink()
    victim = next(r for r in after.ranks if r.node == memory_node)
    fake_proc(tmp_path, oom_kills=6)
    kill(victim)
    result = await asyncio.wait_for(task, 240)

    assert result.ok, (result.error, log_of(tmp_path, disk_node), log_of(tmp_path, memory_node))
    full, memory = result.incidents
    for o, kind, node in (
        (full, FailureKind.FILESYSTEM_FULL, disk_node),
        (memory, FailureKind.HOST_MEMORY_EXHAUSTED, memory_node),
    ):
        assert o.kind is kind and o.failure_domain == node, o
        assert o.classification.category is Category.SHARED_INFRASTRUCTURE, o.classification
        assert not o.classification.qualifying and kind.value in o.classification.reason, (
            o.classification
        )
        assert o.disposition is Disposition.FALLBACK_RESTART and o.fallback is not None, o
    assert full.lost_slots == (on_disk_node,) and memory.lost_slots == (victim.slot,)
    assert result.steps_recomputed > 0
    assert result.final_digest == long_reference.final_digest


async def training(
    job: JobSpec, task: asyncio.Task[JobResult], incidents: int, spares: int = 0
) -> wire.Status:
    """The job's status once it trains on all four ranks, with `spares` warm spares, past step 25 (a
    checkpoint at 19 to fall back to), after `incidents` incidents."""
    now = await status(job)
    while (
        now.state != "training"
        or now.incidents < incidents
        or len(now.ranks) < 4
        or now.spares < spares
        or min(r.step for r in now.ranks) < 25
    ):
        assert not task.done(), (await task).error
        await asyncio.sleep(0.05)
        now = await status(job)
    return now
