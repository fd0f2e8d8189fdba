"""The coordinator of a multi-node job is no single point of failure: SIGKILLed mid-job, it leaves
every rank training (the node agents keep them and wait for it); started again with the same
command, it takes the job back in the generation it was in, and the next failure is migrated live.

Real parts: the coordinator is the real `torchpass run --remote` CLI as a subprocess (killed and
rerun), the node agents real `torchpass node` processes on hosts that are network namespaces (or
loopback addresses: the test prints which), ranks real gloo processes, the incident a
MigrationWorkflow on the real dev server. The run must end bitwise equal to the same job never
interrupted, with no step recomputed."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from temporalio.client import Client

from job_agent import wire
from job_agent.coordinator.jobs import UnknownJob, request
from job_agent.coordinator.resume import latest_checkpoint
from tests.integration.conftest import SCRIPT, kill, run_with, spec
from tests.integration.test_multinode import coordinator_of, log_of, node_argv, status
from tests.integration.test_resume import _cli
from torchpass.dev.hosts import Fabric, fabric
from torchpass.job import JobResult, JobSpec
from torchpass.models import Disposition

STEPS = 400
ARGS = ("--steps", str(STEPS), "--width", "128", "--depth", "2", "--batch", "1024")


@pytest.fixture
def hosts() -> Iterator[Fabric]:
    with fabric(3) as f:
        print(f"multi-node test hosts: {f.mode} ({', '.join(h.address for h in f.hosts)})")
        yield f


def coordinator(client: Client, state: Path, host: str, job_id: str) -> subprocess.Popen[str]:
    """`torchpass run --remote` for a job of 2 nodes x 2 ranks: the same command each time."""
    run = (
        "run",
        "--job-id",
        job_id,
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--remote",
        "--host",
        host,
    )
    timeouts = ("--hang-timeout", "1.5", "--node-timeout", "3", "--checkpoint-every", "20")
    return _cli(client, state, *run, *timeouts, str(SCRIPT), "--", *ARGS)


@pytest.fixture(scope="module")
async def reference(client: Client, tmp_path_factory: pytest.TempPathFactory) -> JobResult:
    result = await run_with(
        client, spec(tmp_path_factory.mktemp("ref"), "restart-reference", spares=0, args=ARGS)
    )
    assert result.ok and result.final_digest
    return result


@pytest.mark.parametrize(
    "away", [False, True], ids=["rank-killed-once-back", "rank-killed-while-away"]
)
async def test_a_coordinator_killed_mid_job_is_started_again_and_takes_the_job_back_live(
    client: Client, tmp_path: Path, hosts: Fabric, reference: JobResult, away: bool
) -> None:
    """Killed once back: the job trains on without its coordinator, is taken back in the same
    generation with the same processes, and a rank killed then is migrated live. Killed while away:
    the survivors' collectives fail and they wait, frozen, for their coordinator; its node agent
    kept the rank's exit, and the coordinator started again finds the slot empty and migrates it
    live."""
    state, job_id = tmp_path / "state", "mn-restart"
    # where the CLI keeps the job
    job = spec(state, job_id, args=ARGS, nodes=2, host=hosts.coordinator)
    first = coordinator(client, state, hosts.coordinator, job_id)
    second: subprocess.Popen[str] | None = None
    try:
        address = await coordinator_of(job)
        a, b, spare = hosts.hosts
        for h, held, spares in ((spare, 0, 2), (a, 2, 0), (b, 2, 0)):
            hosts.start(
                h,
                node_argv(job, address, h, held, spares, args=ARGS),
                str(tmp_path / f"{h.name}.log"),
            )
            deadline = time.monotonic() + 30
            while "joined job" not in log_of(tmp_path, h.name):
                assert time.monotonic() < deadline and first.poll() is None, log_of(
                    tmp_path, h.name
                )
                await asyncio.sleep(0.05)
        before = await status(job)
        while (
            before.state != "training"
            or before.spares < 2
            or min((r.step for r in before.ranks), default=0) < 3
        ):
            assert first.poll() is None, first.communicate()[0]
            await asyncio.sleep(0.05)
            before = await status(job)

        first.send_signal(signal.SIGKILL)
        first.wait(10)
        at = max(r.step for r in before.ranks)
        if away:
            kill(next(r for r in before.ranks if r.slot == 1))
            # Part of the scenario: the coordinator stays away while the others find their
            # collective broken and freeze. Nothing outside can see them freeze with their
            # coordinator dead (they tell it alone): a fixed time.
            await asyncio.sleep(3)
        else:
            # Training goes on without it: rank 0 writes checkpoints past the step it was at.
            deadline = time.monotonic() + 60
            while (latest_checkpoint(job.job_dir) or (-1, ""))[0] < at + 20:
                assert time.monotonic() < deadline, (
                    f"no progress without the coordinator; {log_of(tmp_path, 'node0')}"
                )
                await asyncio.sleep(0.05)

        second = coordinator(client, state, hosts.coordinator, job_id)
        if not away:
            await _taken_back(job, second, before, at, tmp_path, hosts)
        out, _ = await asyncio.to_thread(second.communicate, None, 180)
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert second.returncode == 0, out
    result = JobResult.model_validate_json((job.job_dir / "result.json").read_text())
    assert result.ok and result.resumed is None, result
    (o,) = result.incidents
    assert o.disposition is Disposition.MIGRATED and o.success and o.lost_slots == (1,), o
    assert result.generation == before.generation + 1
    assert result.steps_recomputed == 0 and o.steps_recomputed == 0
    assert result.final_digest == reference.final_digest


async def _taken_back(
    job: JobSpec,
    second: subprocess.Popen[str],
    before: wire.Status,
    at: int,
    tmp_path: Path,
    hosts: Fabric,
) -> None:
    """The restarted coordinator holds the same world, training past where the first was killed;
    then a rank is killed."""
    back: wire.Status | None = None
    deadline = time.monotonic() + 60
    while (
        back is None
        or back.state != "training"
        or len(back.ranks) < 4
        or back.spares < 2
        or min(r.step for r in back.ranks) <= at
    ):
        if time.monotonic() > deadline or second.poll() is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(second.pid, signal.SIGKILL)
            logs = "\n".join(log_of(tmp_path, h.name)[-3000:] for h in hosts.hosts)
            pytest.fail(f"not taken back: {back}\n{second.communicate()[0][-5000:]}\n{logs}")
        await asyncio.sleep(0.1)
        with contextlib.suppress(OSError, AssertionError, UnknownJob):  # not yet registered
            back = await status(job)
    print(
        f"coordinator killed at step {at}; taken back at {min(r.step for r in back.ranks)} of "
        f"{STEPS}"
    )
    assert back.generation == before.generation, (before, back)  # the same world: nothing restarted
    assert {r.agent for r in back.ranks} == {r.agent for r in before.ranks}
    victim = next(r for r in back.ranks if r.slot == 1)
    kill = wire.Inject(action=wire.InjectAction.KILL, slot=1, after_step=victim.step + 5)
    assert isinstance(await asyncio.to_thread(request, job.state_dir, job.job_id, kill), wire.Ok)
