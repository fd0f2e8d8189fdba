"""A coordinator lost mid-job (SIGKILL: an OOM kill or its host gone look the same) and the job run
again: the real CLI as a subprocess, the real dev server, real ranks that die with their
coordinator.

The lost job stays listed (`torchpass jobs`: lost); `torchpass run` with its id resumes every rank
from its latest checkpoint, counts the completed steps it runs again from the ranks' own reports,
and ends bitwise equal to a run that was never interrupted. On the previous main the rerun started
at step 0 over the lost run's files and said nothing of it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

from temporalio.client import Client

from job_agent.coordinator.jobs import registered_jobs, wait_until_ready
from job_agent.coordinator.resume import PROGRESS, latest_checkpoint
from tests.integration.conftest import SCRIPT, run_with, spec
from tests.integration.test_stop import _ranks_of

ARGS = ("--steps", "1500", "--width", "64", "--depth", "1")
EVERY = 100


def _cli(client: Client, state_dir: Path, *args: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "torchpass.cli", *args]
    if args[0] == "run":
        cmd[4:4] = ["--address", client.service_client.config.target_host]
    env = {**os.environ, "TORCHPASS_STATE_DIR": str(state_dir)}
    return subprocess.Popen(
        cmd,
        env=env,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _completed(job_dir: Path) -> int:
    try:
        return int(json.loads((job_dir / PROGRESS).read_text())["completed"])
    except (OSError, ValueError):
        return -1


async def test_a_job_whose_coordinator_was_killed_resumes_from_its_checkpoint_bitwise(
    client: Client, tmp_path: Path
) -> None:
    job_id, job_dir = "lose-me", tmp_path / "jobs" / "lose-me"
    run = (
        "run",
        "--job-id",
        job_id,
        "--nproc",
        "2",
        "--spares",
        "1",
        "--checkpoint-every",
        str(EVERY),
    )
    first = _cli(client, tmp_path, *run, str(SCRIPT), "--", *ARGS)
    try:
        await asyncio.to_thread(wait_until_ready, tmp_path, job_id, timedelta(seconds=90))
        deadline = time.monotonic() + 90
        while True:  # a checkpoint, and steps completed past it: work the rerun must redo
            checkpoint = latest_checkpoint(job_dir)
            if checkpoint is not None and _completed(job_dir) >= checkpoint[0] + 10:
                break
            assert time.monotonic() < deadline and first.poll() is None, (
                "the job never got that far"
            )
            await asyncio.sleep(0.01)
        first.send_signal(signal.SIGKILL)  # the coordinator alone: its ranks die of its death
        first.wait(10)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
        first.communicate()
    deadline = time.monotonic() + 10
    while _ranks_of(tmp_path) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert _ranks_of(tmp_path) == []
    lost_at, (step, path) = _completed(job_dir), latest_checkpoint(job_dir) or (-1, None)
    assert step >= EVERY - 1 and lost_at > step

    (listed,) = registered_jobs(tmp_path)
    assert listed["job_id"] == job_id and not listed["alive"]
    jobs = _cli(client, tmp_path, "jobs")
    out, _ = jobs.communicate(timeout=30)
    assert f"{job_id}\tlost" in out, out

    again = _cli(client, tmp_path, *run, str(SCRIPT), "--", *ARGS)
    out, _ = await asyncio.to_thread(again.communicate, timeout=150)
    assert again.returncode == 0, out
    result = json.loads((job_dir / "result.json").read_text())
    resumed = result["resumed"]
    assert resumed["checkpoint"] == str(path) and resumed["checkpoint_step"] == step
    assert resumed["last_completed"] == lost_at and "was lost" in resumed["previous"]
    # measured: the steps the ranks entered again
    assert result["steps_recomputed"] == lost_at - step
    assert f"resumed at step {step + 1}" in out and "Traceback" not in out, out
    assert not registered_jobs(tmp_path) and not (job_dir / PROGRESS).exists()

    never_lost = spec(tmp_path / "ref", "never-lost", nproc=2, args=ARGS, checkpoint_every=EVERY)
    reference = await run_with(client, never_lost)
    assert reference.ok and not reference.incidents
    assert result["final_digest"] == reference.final_digest
