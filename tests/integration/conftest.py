"""Integration tier: the real Temporal dev server, the real control worker, real torch.distributed
ranks.

Nothing is mocked here: ranks are separate Python processes running gloo on CPU, failures are real
SIGKILLs and SIGSTOPs, and every incident runs through MigrationWorkflow on a real server.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

import pytest
from temporalio.client import Client

from job_agent import wire
from job_agent.coordinator.jobs import request, running_jobs
from job_agent.wire.operator import RankStatus
from tests.unit.job_driver import SHARED_PEERS
from torchpass.dev.server import start_dev_server
from torchpass.job import JobResult, JobSpec
from workers.control import control_worker
from workers.job import run_job

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_dp.py"
STEPS = 60
SCRIPT_ARGS = ("--steps", str(STEPS), "--width", "128", "--depth", "2")


@pytest.fixture(scope="session")
async def client() -> AsyncIterator[Client]:
    env = await start_dev_server()
    SHARED_PEERS.add(env.client.service_client.config.target_host)
    async with env, control_worker(env.client):
        yield env.client


def spec(state_dir: Path, job_id: str, spares: int = 1, **kw: object) -> JobSpec:
    fields: dict[str, object] = {
        "job_id": job_id,
        "script": SCRIPT,
        "args": SCRIPT_ARGS,
        "nproc": 4,
        "spares": spares,
        "state_dir": state_dir,
        "hang_timeout": 1.5,
        "checkpoint_every": 20,
        **kw,
    }
    return JobSpec.model_validate(fields)


async def start_job(client: Client, job: JobSpec) -> asyncio.Task[JobResult]:
    """Launch a job; return its task once its coordinator has registered (requests can reach it)."""
    task = asyncio.create_task(run_job(job, client))
    deadline = time.monotonic() + 60
    while not any(j["job_id"] == job.job_id for j in running_jobs(job.state_dir)):
        if time.monotonic() > deadline or task.done():
            task.cancel()
            raise AssertionError(
                "job never registered" if not task.done() else "job ended before it registered"
            )
        await asyncio.sleep(0.05)
    return task


async def run_with(
    client: Client,
    job: JobSpec,
    injections: Sequence[tuple[str, int, int] | wire.Inject] = (),
    timeout: float = 150,
) -> JobResult:
    """Run a job to its end, injecting (action, rank, at_step), or any `Inject`, through its
    coordinator's control channel."""
    if not injections:
        return await asyncio.wait_for(run_job(job, client), timeout)
    task = await start_job(client, job)
    for item in injections:
        if isinstance(item, wire.Inject):
            inject = item
        else:
            action, rank, step = item
            inject = wire.Inject(action=wire.InjectAction(action), slot=rank, after_step=step)
        reply = await asyncio.to_thread(request, job.state_dir, job.job_id, inject)
        assert isinstance(reply, wire.Ok), reply
    return await asyncio.wait_for(task, timeout)


@pytest.fixture(scope="session")
async def reference(client: Client, tmp_path_factory: pytest.TempPathFactory) -> JobResult:
    """The same job, never failed: the state every migrated run must match bit for bit."""
    result = await run_with(client, spec(tmp_path_factory.mktemp("ref"), "reference", spares=0))
    assert result.ok and result.final_digest and not result.incidents
    return result


# A job long enough to outlast what a test does to it from outside while it trains (a detector's
# signal, a GPU's state read once a second, two migrations in a row) on a fast machine.
LONG_ARGS = ("--steps", "1000", "--width", "128", "--depth", "2")


@pytest.fixture(scope="session")
async def long_reference(client: Client, tmp_path_factory: pytest.TempPathFactory) -> JobResult:
    """The job of LONG_ARGS on one host, never failed: one run for every test that needs it."""
    result = await run_with(
        client,
        spec(tmp_path_factory.mktemp("long-ref"), "long-reference", spares=0, args=LONG_ARGS),
    )
    assert result.ok and result.final_digest and not result.incidents, result.error
    return result


def kill(rank: RankStatus) -> None:
    """SIGKILL a rank's process, found by the pid it said in its hello, which the job's status shows
    (the tests' hosts share this host's PID namespace; a forked rank's environment in /proc is its
    fork server's, so it cannot be found there)."""
    assert rank.pid > 1, f"no pid for {rank}"  # os.kill(-1, ...) would signal every process
    os.kill(rank.pid, signal.SIGKILL)


def _training_children() -> list[int]:
    """This process's training processes: ranks and spares started cold, and every child of its fork
    servers (a server itself lives as long as this process)."""
    parents: dict[int, int] = {}
    cmds: dict[int, bytes] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmds[int(pid)] = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        parents[int(pid)] = int(stat.rsplit(")", 1)[1].split()[1])
    children = {pid for pid, ppid in parents.items() if ppid == os.getpid()}
    servers = {pid for pid in children if b"job_agent.launch.forkserver" in cmds[pid]}
    forked = {pid for pid, ppid in parents.items() if ppid in servers}
    return sorted({pid for pid in children if b"train_dp.py" in cmds[pid]} | forked)


@pytest.fixture(autouse=True)
def no_leaked_processes() -> Iterator[None]:
    yield
    deadline = time.monotonic() + 10
    while _training_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _training_children() == [], "training processes left running after the test"
