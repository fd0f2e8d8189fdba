"""What a job leaves on disk and hands its ranks: its owner's alone, its secrets not passed on.

Real files and, for the environment, a real child process started by the real `LocalLauncher`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from job_agent import wire
from job_agent.coordinator.ending import put_away
from job_agent.coordinator.jobs import JobIdInUse, register_job, unregister_job
from job_agent.coordinator.node_launcher import NodeLauncher
from job_agent.coordinator.resume import ProgressFile
from job_agent.launch.launcher import LocalLauncher, die_with_parent, inherited_env
from job_agent.rank.state import TrackedState
from tests.unit.job_driver import Counts, Job, Migration, poll_until
from torchpass.job import JobResult, JobSpec, JobState


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


@pytest.fixture
def umask_022() -> Iterator[None]:
    """The usual umask, under which a file opened plainly is 0644: readable by every local user."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def test_a_jobs_directory_and_secret_are_its_owners_alone(tmp_path: Path) -> None:
    job_dir = tmp_path / "jobs" / "j1"
    register_job(job_dir, b"s" * 32, "127.0.0.1:1", 2)
    assert _mode(job_dir) == 0o700 and _mode(job_dir / "secret") == 0o600
    assert _mode(job_dir / "job.json") == 0o600
    unregister_job(job_dir)
    assert not (job_dir / "secret").exists() and not (job_dir / "job.json").exists()


def test_a_link_planted_at_the_secret_is_never_written_through(tmp_path: Path) -> None:
    job_dir, target = tmp_path / "j2", tmp_path / "victim"
    job_dir.mkdir()
    target.write_text("precious")
    (job_dir / "secret").symlink_to(target)
    register_job(job_dir, b"s" * 32, "127.0.0.1:1", 2)
    assert not (job_dir / "secret").is_symlink() and target.read_text() == "precious"


def test_a_job_id_already_running_here_is_refused_and_a_dead_ones_secret_replaced(
    tmp_path: Path,
) -> None:
    job_dir = tmp_path / "j3"
    register_job(job_dir, b"a" * 32, "127.0.0.1:1", 2)
    info = json.loads((job_dir / "job.json").read_text())
    (job_dir / "job.json").write_text(json.dumps({**info, "pid": os.getppid()}))  # alive, not us
    with pytest.raises(JobIdInUse, match="already running"):
        register_job(job_dir, b"b" * 32, "127.0.0.1:2", 2)
    (job_dir / "job.json").write_text(json.dumps({**info, "pid": 2**22 + 7}))  # no such process
    register_job(job_dir, b"c" * 32, "127.0.0.1:3", 2)
    assert (job_dir / "secret").read_text() == (b"c" * 32).hex()


def test_a_checkpoint_is_readable_by_its_owner_only(tmp_path: Path) -> None:
    state = TrackedState(torch.nn.Linear(2, 2))
    state.save_checkpoint(tmp_path / "ckpt" / "step-00000001.pt", 1)
    assert (
        _mode(tmp_path / "ckpt") == 0o700 and _mode(tmp_path / "ckpt" / "step-00000001.pt") == 0o600
    )


async def test_every_file_a_job_writes_in_its_directory_is_its_owners_alone(
    tmp_path: Path, allowance: Counts, umask_022: None
) -> None:
    """A job with an incident, run to its end under umask 022: its incident log and its result, like
    its secret, are 0600 (incidents.jsonl and result.json were 0644, readable by any local user)."""
    job = Job(tmp_path, allowance, nproc=3)
    job.launcher.fail_at(1, 4)
    async with job:
        workflow_id, report = await job.report()
        await Migration(job, workflow_id, report).run()
        await job.finished()
    files = {
        str(p.relative_to(job.spec.job_dir)): _mode(p)
        for p in job.spec.job_dir.rglob("*")
        if not p.is_dir()
    }
    assert {"incidents.jsonl", "result.json"} <= set(files), files
    assert {name: mode for name, mode in files.items() if mode != 0o600} == {}


def test_a_nodes_roll_and_the_jobs_progress_are_their_owners_alone(
    tmp_path: Path, umask_022: None
) -> None:
    """The roll of the job's nodes (written as one joins) and its progress file: 0600."""
    launcher = NodeLauncher("j", 1, lambda agent: False, job_dir=tmp_path)
    near, far = socket.socketpair()
    with near, far:
        hello = wire.NodeHello(job_id="j", node="a", host="198.18.0.1", slots=1, spares=0, pid=1)
        assert launcher.join(near, hello) is None
    ProgressFile(tmp_path).write(3)
    assert (_mode(tmp_path / "nodes.json"), _mode(tmp_path / "progress.json")) == (0o600, 0o600)


def test_a_result_is_never_written_through_a_link_and_an_old_wide_one_is_narrowed(
    tmp_path: Path, umask_022: None
) -> None:
    """`result.json` left 0644 by an older version is 0600 once written again; a link planted in
    its place is never written through (it was: the link's target got the job's result)."""
    (tmp_path / "train.py").touch()
    spec = JobSpec(script=tmp_path / "train.py", nproc=1, state_dir=tmp_path)
    spec.job_dir.mkdir(parents=True)
    result = JobResult(job_id=spec.job_id, status=JobState.FAILED, steps_completed=0, generation=0)
    progress = ProgressFile(spec.job_dir)
    (spec.job_dir / "result.json").write_text("{}")
    os.chmod(spec.job_dir / "result.json", 0o644)
    put_away(spec, result, progress)
    assert _mode(spec.job_dir / "result.json") == 0o600
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (spec.job_dir / "result.json").unlink()
    (spec.job_dir / "result.json").symlink_to(victim)
    with pytest.raises(OSError):
        put_away(spec, result, progress)
    assert victim.read_text() == "precious"


def test_ranks_inherit_the_users_environment_but_none_of_torchpass_settings(tmp_path: Path) -> None:
    parent = {
        "PATH": os.environ.get("PATH", ""),
        "MY_DATASET": "/data/x",
        "TORCHPASS_TEMPORAL_API_KEY": "key-that-must-not-leak",
        "TORCHPASS_BILLING_WEBHOOK_SECRET": "another",
    }
    assert inherited_env(parent) == {"PATH": parent["PATH"], "MY_DATASET": "/data/x"}
    script, out = tmp_path / "dump.py", tmp_path / "env.json"
    script.write_text(
        f"import json, os\nopen({str(out)!r}, 'w').write(json.dumps(dict(os.environ)))\n"
    )
    launcher = LocalLauncher(str(script), (), base_env=parent)
    launcher.spawn("rank0-1", {"TORCHPASS_JOB_ID": "j"})
    poll_until(
        lambda: launcher.poll("rank0-1") is not None,
        "the rank to write its environment and exit",
        30,
    )
    launcher.shutdown(timedelta(seconds=5))
    seen = json.loads(out.read_text())
    assert seen["MY_DATASET"] == "/data/x" and seen["TORCHPASS_JOB_ID"] == "j"
    assert (
        "TORCHPASS_TEMPORAL_API_KEY" not in seen and "TORCHPASS_BILLING_WEBHOOK_SECRET" not in seen
    )


def test_nothing_starts_once_the_launcher_shuts_down(tmp_path: Path) -> None:
    """A spare replaced while the job stopped used to start during shutdown (and change the process
    list shutdown was walking): it was left running after the job."""
    script = tmp_path / "sleep.py"
    script.write_text("import time\ntime.sleep(60)\n")
    launcher = LocalLauncher(str(script), (), base_env={"PATH": os.environ.get("PATH", "")})
    launcher.spawn("spare-1", {})
    launcher.shutdown(timedelta(seconds=5))
    assert launcher.poll("spare-1") is not None
    with pytest.raises(RuntimeError, match="shutting down"):
        launcher.spawn("spare-2", {})
    assert launcher.pid("spare-2") is None


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie is dead, waiting for whoever adopted it to reap it


@pytest.mark.skipif(not die_with_parent(), reason="needs Linux and util-linux's setpriv")
@pytest.mark.parametrize("fork", ["1", "0"], ids=["forked", "cold"])
def test_a_killed_coordinator_leaves_no_rank_behind_not_even_a_stopped_one(
    tmp_path: Path, fork: str
) -> None:
    """A stand-in coordinator (a real process using the real LocalLauncher) starts a rank, forked
    from the fork server or started cold, the rank is stopped as a hang stops it, and the
    coordinator is SIGKILLed: the kernel kills the rank too (forked: the server dies with the
    coordinator, the rank with it)."""
    rank, started = tmp_path / "rank.py", tmp_path / "started"
    rank.write_text(
        f"import pathlib, time\npathlib.Path({str(started)!r}).touch()\ntime.sleep(120)\n"
    )
    coordinator = tmp_path / "coordinator.py"
    coordinator.write_text(
        "import sys, time\n"
        "from job_agent.launch.launcher import LocalLauncher\n"
        f"launcher = LocalLauncher({str(rank)!r}, ())\n"
        "launcher.spawn('rank0-1', {})\n"
        "print(launcher.pid('rank0-1'), flush=True)\n"
        "time.sleep(120)\n"
    )
    root = Path(__file__).resolve().parents[2]
    parent = subprocess.Popen(
        [sys.executable, str(coordinator)],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(root), "TORCHPASS_FORK_SERVER": fork},
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    try:
        # Until the rank runs its script: its death signal is armed by then.
        poll_until(started.exists, "the rank to run its script", timeout=60)
        os.kill(child, signal.SIGSTOP)  # hung
        parent.kill()
        parent.wait(10)
        poll_until(
            lambda: not _running(child), "the rank to die with its coordinator (it outlived it)"
        )
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
