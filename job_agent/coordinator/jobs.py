"""Finding running jobs on this host and talking to their coordinators (`torchpass inject`,
`jobs`)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from job_agent import wire
from job_agent.coordinator.private_files import open_private
from job_agent.wire import protocol
from torchpass.incident.attestation import JobKey
from torchpass.job import JobSpec, JobState

KEY_FILE = "attest.key"


def register(spec: JobSpec, secret: bytes, coordinator: str, store: str | None) -> None:
    """`register_job` for `spec`'s job; a job that asks for spare nodes also says how to start the
    node agent of one (what the cluster detector keeping them needs:
    `workers.detectors.spare_nodes`)."""
    spare_node = None
    if spec.spare_nodes:
        spare_node = {
            "count": spec.spare_nodes,
            # a spare node can take a whole node's ranks
            "spares": spec.nproc // max(spec.nodes, 1),
            "script": str(spec.script),
            "args": list(spec.args),
        }
    register_job(spec.job_dir, secret, coordinator, spec.nproc, store, spare_node)


def register_job(
    job_dir: Path,
    secret: bytes,
    coordinator: str,
    world_size: int,
    store: str | None = None,
    spare_node: Mapping[str, object] | None = None,
) -> None:
    """Where `torchpass inject` and `torchpass jobs` find a job. The job's directory is its owner's
    alone (0700); the secret is created exclusively (0600, never through a link) and
    `unregister_job` removes it.

    A secret left by a coordinator that died is replaced; one of a coordinator still running is an
    error: two jobs cannot share an id on one host."""
    job_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(job_dir, 0o700)  # made by an older version, or by hand
    path = job_dir / "secret"
    if path.exists() or path.is_symlink():
        refuse_if_running(job_dir)
        path.unlink()
    with open_private(path, "x") as f:
        f.write(secret.hex())
    info: dict[str, object] = {
        "job_id": job_dir.name,
        "coordinator": coordinator,
        "store": store,
        "pid": os.getpid(),
        "world_size": world_size,
        "started_at": datetime.now(UTC).isoformat(),
    }
    if spare_node is not None:
        info["spare_node"] = dict(spare_node)
    with open_private(job_dir / "job.json") as f:
        f.write(json.dumps(info, indent=2))


def job_key(job_dir: Path) -> JobKey:
    """The key the job attests its incidents with (`torchpass.incident.attestation`): made on its
    first start, kept in its directory (0600, never through a link) across coordinator restarts and
    after it ends, so that a job resumed under its id stays the job its contract registered."""
    job_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = job_dir / KEY_FILE
    try:
        f = open_private(path, "x")
    except FileExistsError:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd) as existing:
            return JobKey.from_hex(existing.read())
    key = JobKey.generate()
    with f:
        f.write(key.private_hex())
    return key


def unregister_job(job_dir: Path) -> None:
    """The job ended: nobody can reach its coordinator any more, and its secret protects nothing."""
    for name in ("job.json", "secret"):
        (job_dir / name).unlink(missing_ok=True)


def registered_pid(job_dir: Path) -> int | None:
    """The pid of the coordinator registered for this job (running, or dead without
    unregistering)."""
    try:
        return int(json.loads((job_dir / "job.json").read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def refuse_if_running(job_dir: Path) -> None:
    """`JobIdInUse` if a coordinator still running here is registered for this job."""
    owner = registered_pid(job_dir)
    if owner is not None and owner != os.getpid() and alive(owner):
        raise JobIdInUse(f"job {job_dir.name} is already running here (coordinator pid {owner})")


def alive(pid: int) -> bool:
    if pid <= 0:  # 0 and negatives name process groups, not a coordinator
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class JobIdInUse(Exception):
    """Another coordinator on this host runs a job with that id."""


class UnknownJob(Exception):
    """No running job of that id on this host."""


def running_jobs(state_dir: Path) -> list[dict[str, Any]]:
    """Registry entries of jobs whose coordinator process is still alive."""
    return [info for info in registered_jobs(state_dir) if info["alive"]]


def registered_jobs(state_dir: Path) -> list[dict[str, Any]]:
    """Every registry entry, `alive` saying whether its coordinator still runs: one that is not was
    lost (killed, or its host went down) with its job unfinished; `torchpass run` with its id
    resumes it."""
    out = []
    for path in sorted((state_dir / "jobs").glob("*/job.json")):
        try:
            info = json.loads(path.read_text())
            info["alive"] = alive(int(info["pid"]))
        except (OSError, ValueError, KeyError, TypeError):
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
    return ask(info, frame, timeout)


def ask(
    info: dict[str, Any], frame: wire.Frame, timeout: timedelta = REQUEST_TIMEOUT
) -> wire.Frame:
    """One authenticated request to the coordinator of a registry entry (`registered_jobs`); its
    reply. Its pid says nothing where the coordinator runs on another host: a job gone answers
    nothing."""
    job_id = info["job_id"]
    secret_file = Path(info["dir"]) / "secret"
    try:
        secret = bytes.fromhex(secret_file.read_text().strip())
    except (OSError, ValueError) as e:
        raise UnknownJob(f"job {job_id}: its secret {secret_file} cannot be read ({e})") from None
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
            if (
                isinstance(last, wire.Status)
                and last.state is JobState.TRAINING
                and last.spares >= 1
            ):
                return last
        time.sleep(0.1)
    raise TimeoutError(f"job {job_id} not training with a warm spare after {timeout}: {last}")
