"""Ctrl-C at a terminal running `torchpass run`: the whole foreground process group gets SIGINT, as
here (the real CLI as a subprocess in a session of its own, the real dev server, real ranks). The
job stops the orderly way, within seconds: every rank freezes at one step boundary and says what it
holds, and its result is written with status `stopped`, the steps completed and the digest of that
state (the same script run to exactly that step ends with it), said once; its registration and
secret are removed, and no rank is left behind. Before, the interrupt left no result; then a result
saying "failed after 0 steps" with the digest of an empty state, the stop line printed once per
process."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

from temporalio.client import Client

from job_agent import wire
from job_agent.coordinator.jobs import request, running_jobs, wait_until_ready
from tests.integration.conftest import SCRIPT, spec
from workers.job import run_job


def _status(state_dir: Path, job_id: str) -> wire.Status:
    answer = request(state_dir, job_id, wire.StatusRequest())
    assert isinstance(answer, wire.Status), answer
    return answer


def _ranks_of(state_dir: Path) -> list[int]:
    """Processes running the training script for jobs under `state_dir` (any parent)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        # Started cold, its environment names the state directory; forked, its command line the job.
        if b"train_dp.py" in cmd and (
            str(state_dir).encode() in env or b"[torchpass stop-me/" in cmd
        ):
            found.append(int(pid))
    return found


async def test_ctrl_c_stops_the_job_in_order_and_records_it(client: Client, tmp_path: Path) -> None:
    job_id = "stop-me"
    cmd = [
        *(
            sys.executable,
            "-m",
            "torchpass.cli",
            "run",
            "--address",
            client.service_client.config.target_host,
        ),
        *("--job-id", job_id, "--nproc", "2", "--spares", "1"),
        *(str(SCRIPT), "--", "--steps", "100000", "--width", "64", "--depth", "1"),
    ]
    env = {**os.environ, "TORCHPASS_STATE_DIR": str(tmp_path)}
    proc = subprocess.Popen(
        cmd,
        env=env,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        await asyncio.to_thread(wait_until_ready, tmp_path, job_id, timedelta(seconds=90))
        job_dir = tmp_path / "jobs" / job_id
        assert (job_dir / "secret").exists() and _ranks_of(tmp_path)
        await asyncio.sleep(3)  # some steps done
        before = max(r.step for r in (await asyncio.to_thread(_status, tmp_path, job_id)).ranks)
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        out, _ = await asyncio.to_thread(proc.communicate, timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0, out
    result = json.loads((job_dir / "result.json").read_text())
    assert result["status"] == "stopped" and "stopped by SIGINT" in result["error"], result
    # the steps really completed (at least those before the one in flight as it was read: a step
    # in flight at the stop may be left undone), and the digest of the state really held
    assert result["steps_completed"] >= before > 0, (before, result)
    digest = result["final_digest"]
    assert digest and digest != hashlib.sha256(b"").hexdigest(), result
    assert out.count("stopped by SIGINT") == 1, out  # said once, not once per process
    assert took < 15, took
    assert not (job_dir / "secret").exists() and not running_jobs(tmp_path)
    deadline = time.monotonic() + 10
    while _ranks_of(tmp_path) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert _ranks_of(tmp_path) == []
    assert "Traceback" not in out, out
    # The digest is of the state the ranks held: the same script run to exactly that many steps
    # ends there.
    steps = str(result["steps_completed"])
    args = ("--steps", steps, "--width", "64", "--depth", "1")
    reference = await run_job(spec(tmp_path / "ref", "stop-reference", nproc=2, args=args), client)
    assert reference.ok and reference.final_digest == digest, (reference, result)
