"""Ctrl-C at a terminal running `torchpass run`: the whole foreground process group gets SIGINT, as
here (the real CLI as a subprocess in a session of its own, the real dev server, real ranks). The
job stops the orderly way: its result is written with why, its registration and secret are removed,
and no rank is left behind. On the previous main the interrupt left no result, the job registered
and its secret on disk."""

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

from job_agent.coordinator.jobs import running_jobs, wait_until_ready
from tests.integration.conftest import SCRIPT


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
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        out, _ = await asyncio.to_thread(proc.communicate, timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0, out
    result = json.loads((job_dir / "result.json").read_text())
    assert result["status"] == "failed" and "stopped by SIGINT" in result["error"], result
    assert not (job_dir / "secret").exists() and not running_jobs(tmp_path)
    deadline = time.monotonic() + 10
    while _ranks_of(tmp_path) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert _ranks_of(tmp_path) == []
    assert "Traceback" not in out, out
