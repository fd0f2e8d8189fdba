"""What a running job says of itself for environment validation (`job_agent.coordinator.describe`):
the real coordinator over fake ranks, each saying in its hello what its own torch offers. The
coordinator imports no torch, so nothing of its own host can stand in for the ranks'."""

from __future__ import annotations

from pathlib import Path

from job_agent import wire
from job_agent.coordinator.describe import describe
from tests.unit.fake_ranks import ENVIRONMENT
from tests.unit.job_driver import Counts, Job, until
from torchpass.job import JobState
from torchpass.validation.checks import evaluate_job
from torchpass.validation.facts import JobDescription
from torchpass.validation.report import Check, CheckResult


def checks_of(d: JobDescription) -> dict[str, CheckResult]:
    return {c.name: c for c in evaluate_job(d)}


async def test_the_ranks_say_their_environment_and_a_host_without_nccl_fails_the_backend_check(
    tmp_path: Path, allowance: Counts
) -> None:
    """Two ranks on CPU hosts, one on a GPU host whose torch has no NCCL: the description groups
    them by what they said, and the backend check fails naming the odd rank alone."""
    gpu = wire.Environment(
        torch_version="2.13.0+cu128", backend="nccl", backend_available=False, cuda_available=True
    )
    job = Job(tmp_path, allowance, nproc=3)
    job.launcher.environments[2] = gpu
    job.launcher.step_seconds = 0.1  # it trains long enough to be described while it does
    async with job:
        await until(lambda: job.coordinator.state is JobState.TRAINING, "the job to train")
        d = describe(job.coordinator)
        await job.finished()
    cpu = ENVIRONMENT.model_dump()
    assert [(e.slots, e.model_dump(exclude={"slots", "nodes"})) for e in d.environments] == [
        ((0, 1), cpu),
        ((2,), gpu.model_dump()),
    ]
    # the fake launcher gives each rank a node of its own
    assert [len(e.nodes) for e in d.environments] == [2, 1], d.environments
    stack = checks_of(d)[Check.SAME_STACK]
    assert not stack.passed and "the ranks' nodes differ" in stack.detail
    assert "torch 2.13.0+cu128" in stack.detail and "(rank(s) [2])" in stack.detail
    checks = checks_of(d)
    assert checks[Check.TORCH].passed
    backend = checks[Check.BACKEND]
    assert not backend.passed and "rank(s) [2]: backend nccl: NOT available" in backend.detail
    assert "rank(s) [0, 1]: backend gloo: available" in backend.detail
