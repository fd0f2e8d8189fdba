"""Finding running jobs on this host and talking to their coordinators (`torchpass inject`, `jobs`)."""

from __future__ import annotations

import json
import os
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
