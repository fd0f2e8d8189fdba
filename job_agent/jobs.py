"""Finding running jobs on this host and talking to their coordinators (`torchpass inject`, `jobs`)."""

from __future__ import annotations

import json
import os
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from job_agent import protocol, wire


def register_job(job_dir: Path, secret: bytes, coordinator: str, world_size: int) -> None:
    """Where `torchpass inject` and `torchpass jobs` find a job (the secret file is 0600)."""
    job_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(job_dir / "secret", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret.hex())
    info = {
        "job_id": job_dir.name,
        "coordinator": coordinator,
        "pid": os.getpid(),
        "world_size": world_size,
        "started_at": datetime.now(UTC).isoformat(),
    }
    (job_dir / "job.json").write_text(json.dumps(info, indent=2))


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


REQUEST_TIMEOUT = timedelta(seconds=10)


def request(
    state_dir: Path, job_id: str, frame: wire.Frame, timeout: timedelta = REQUEST_TIMEOUT
) -> wire.Frame:
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
        sock.settimeout(timeout.total_seconds())
        protocol.send_frame(sock, frame)
        return protocol.recv_frame(sock)


def wait_until_ready(
    state_dir: Path, job_id: str, timeout: timedelta = timedelta(seconds=120)
) -> wire.Status:
    """Block until the job is training with a warm spare (what validation checks); its status.

    For scripts, demos and tests that opt a job in right after launching it.
    """
    deadline = time.monotonic() + timeout.total_seconds()
    last: wire.Frame | None = None
    while time.monotonic() < deadline:
        try:
            last = request(state_dir, job_id, wire.StatusRequest())
        except (UnknownJob, OSError, protocol.ProtocolError):
            pass  # not registered yet, or between two accepts
        else:
            if isinstance(last, wire.Status) and last.state == "training" and last.spares >= 1:
                return last
        time.sleep(0.1)
    raise TimeoutError(f"job {job_id} not training with a warm spare after {timeout}: {last}")
