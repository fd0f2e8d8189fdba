"""Finding running jobs on this host and talking to their coordinators (`torchpass inject`, `jobs`)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from job_agent import protocol


class UnknownJob(Exception):
    """No running job of that id on this host."""


def running_jobs(state_dir: Path) -> list[dict[str, Any]]:
    """Registry entries of jobs whose coordinator process is still alive."""
    out = []
    for path in sorted((state_dir / "jobs").glob("*/job.json")):
        try:
            info = json.loads(path.read_text())
            os.kill(int(info["pid"]), 0)
        except (OSError, ValueError, KeyError):
            continue
        info["dir"] = str(path.parent)
        out.append(info)
    return out


def request(state_dir: Path, job_id: str, msg: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]:
    """One authenticated request to a job's coordinator; its reply."""
    jobs = {j["job_id"]: j for j in running_jobs(state_dir)}
    info = jobs.get(job_id)
    if info is None:
        known = ", ".join(jobs) or "none"
        raise UnknownJob(f"no running job {job_id!r} under {state_dir} (running: {known})")
    secret = bytes.fromhex((Path(info["dir"]) / "secret").read_text().strip())
    host, _, port = info["coordinator"].rpartition(":")
    sock = protocol.connect(host, int(port), secret, timeout)
    with sock:
        sock.settimeout(timeout)
        protocol.send_frame(sock, msg)
        return protocol.recv_frame(sock)


def wait_until_ready(state_dir: Path, job_id: str, timeout: float = 120.0) -> dict[str, Any]:
    """Block until the job is training with a warm spare (what validation checks); its status.

    For scripts, demos and tests that opt a job in right after launching it.
    """
    deadline = time.monotonic() + timeout
    last: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            last = request(state_dir, job_id, {"t": "status"})
        except (UnknownJob, OSError, protocol.ProtocolError):
            pass  # not registered yet, or between two accepts
        else:
            if last.get("state") == "training" and last.get("spares", 0) >= 1:
                return last
        time.sleep(0.1)
    raise TimeoutError(f"job {job_id} not training with a warm spare after {timeout:.0f} s: {last}")
