"""Bad input gets a clear error and loses nothing: script bugs, unknown jobs or ranks, wrong
secrets."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from temporalio.client import Client

from job_agent import wire
from job_agent.coordinator.jobs import UnknownJob, request, running_jobs
from job_agent.wire import protocol
from tests.integration.conftest import SCRIPT, spec, start_job
from torchpass.job import JobSpec, JobState
from workers.job import run_job

pytestmark = pytest.mark.integration
TORCHPASS = [sys.executable, "-m", "torchpass.cli"]


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*TORCHPASS, *args], capture_output=True, text=True, timeout=60, env=env, check=False
    )


async def test_a_bug_in_the_training_script_is_not_a_migration(
    client: Client, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    job = spec(tmp_path, "user-bug", args=("--steps", "60", "--width", "64", "--fail-at", "12"))
    result = await asyncio.wait_for(run_job(job, client), 120)
    assert result.status == "user_error" and not result.incidents
    assert result.error and "ValueError: bug in the training script at step 12" in result.error
    assert "Traceback" in capfd.readouterr().err  # the user sees their own traceback


def _raw_request(host: str, port: int, secret: bytes, body: bytes) -> wire.Frame:
    """Bytes a well-behaved client could never send, through an authenticated connection."""
    with protocol.connect(host, port, secret, timedelta(seconds=5)) as sock:
        sock.settimeout(5)
        protocol.send_body(sock, body)  # tagged as the channel requires; the body is what is bad
        return protocol.recv_frame(sock)


async def test_a_peer_without_the_secret_is_refused_and_the_job_goes_on(
    client: Client, tmp_path: Path
) -> None:
    job = spec(tmp_path, "intruder", spares=0)
    task = await start_job(client, job)
    info = running_jobs(tmp_path)[0]
    host, _, port = info["coordinator"].rpartition(":")
    with pytest.raises((protocol.AuthError, ConnectionError, OSError)):
        sock = protocol.connect(host, int(port), b"not the secret" * 3, timedelta(seconds=5))
        protocol.send_frame(sock, wire.Inject(action=wire.InjectAction.KILL, slot=0))
        protocol.recv_frame(sock)
    bad_rank = await asyncio.to_thread(
        request, tmp_path, "intruder", wire.Inject(action=wire.InjectAction.KILL, slot=9)
    )
    assert isinstance(bad_rank, wire.Error) and "ranks 0-3" in bad_rank.reason
    secret = (Path(info["dir"]) / "secret").read_text().strip()
    for raw, why in (
        (b'{"t":"inject","action":"pause","slot":1,"seconds":-2}', "inject.seconds"),
        (b'{"t":"inject","action":"explode","slot":1}', "inject.action"),
        (b'{"t":"launch-missiles"}', "unknown frame kind 'launch-missiles'"),
        (b"\x00garbage", "bad frame"),
    ):
        answer = await asyncio.to_thread(_raw_request, host, int(port), bytes.fromhex(secret), raw)
        assert isinstance(answer, wire.Error) and why in answer.reason, (raw, answer)
    result = await asyncio.wait_for(task, 120)
    assert result.ok and not result.incidents
    # The job's directory is its owner's alone, and its secret is gone with it.
    assert (job.job_dir.stat().st_mode & 0o777) == 0o700 and not (job.job_dir / "secret").exists()


def test_inject_into_an_unknown_job_names_the_running_ones(tmp_path: Path) -> None:
    with pytest.raises(UnknownJob, match="no running job 'nope'"):
        request(tmp_path, "nope", wire.Inject(action=wire.InjectAction.KILL, slot=0))
    out = _cli(
        "inject",
        "kill",
        "--job",
        "nope",
        "--rank",
        "1",
        env={"TORCHPASS_STATE_DIR": str(tmp_path), "PATH": ""},
    )
    assert out.returncode == 2 and "no running job 'nope'" in out.stderr


def test_wrong_cli_arguments_get_a_clear_error(tmp_path: Path) -> None:
    out = _cli("inject", "explode", "--job", "x", "--rank", "0")
    assert out.returncode == 2 and "invalid choice" in out.stderr
    out = _cli("run", "--nproc", "0", "--address", "127.0.0.1:1", str(SCRIPT))
    assert out.returncode == 2 and "nproc" in out.stderr and "Traceback" not in out.stderr
    out = _cli("run", str(tmp_path / "missing.py"))
    assert out.returncode == 2 and "training script not found" in out.stderr


def test_run_without_a_reachable_temporal_says_how_to_start_one() -> None:
    # Flags after the script belong to the script, as with torchrun.
    out = _cli("run", "--nproc", "2", "--address", "127.0.0.1:1", str(SCRIPT))
    assert out.returncode == 2, out.stderr
    assert "cannot reach Temporal at 127.0.0.1:1" in out.stderr and "torchpass server" in out.stderr


def test_jobspec_rejects_bad_values(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="job_id"):
        JobSpec(job_id="bad id!", script=SCRIPT, state_dir=tmp_path)
    assert json.loads(JobSpec(script=SCRIPT, state_dir=tmp_path).model_dump_json())["nproc"] == 2


async def test_ranks_that_crash_once_connected_fail_the_job_at_once(
    client: Client, tmp_path: Path
) -> None:
    """A script that dies after its agent connected but before training (a model that cannot be
    built): the job fails within seconds naming the rank, not at the start-up timeout (120 s), and
    is no migration (on the previous main it waited out the whole timeout)."""
    script = tmp_path / "crash.py"
    script.write_text(
        "from job_agent import RankAgent\n"
        "agent = RankAgent()\n"
        "raise ValueError('the model cannot be built')\n"
    )
    job = spec(tmp_path, "crash-at-start", script=script, args=(), startup_timeout=120.0)
    # ends well before it
    result = await asyncio.wait_for(run_job(job, client), job.startup_timeout / 2)
    assert not result.ok and not result.incidents
    # Failed on the rank's exit, named; the start-up timeout's error says "did not all join"
    # instead.
    assert (
        result.error
        and "exited" in result.error
        and "before the job started training" in result.error
    )
    assert "start-up timeout" not in result.error, result.error


AFTER_LOOP = """
import sys, time
import torch
from job_agent import RankAgent

agent = RankAgent()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
agent.track(model, opt)


def step(k):
    opt.zero_grad()
    model(torch.randn(2, 4)).sum().backward()
    agent.all_reduce_gradients()
    opt.step()


agent.run(step, steps=5)
mode, out = sys.argv[1], sys.argv[2]
if mode == "slow":  # saving the model takes a while
    time.sleep(3)
    open(f"{out}/saved-{agent.rank}", "w").write("ok")
elif mode == "raise" and agent.rank == 1:
    raise RuntimeError("could not save the model")
elif mode == "forever":
    time.sleep(600)
"""


@pytest.mark.parametrize("mode", ["slow", "raise", "forever"])
async def test_the_code_after_the_training_loop_gets_its_grace_and_its_failure_reaches_the_result(
    client: Client, tmp_path: Path, mode: str
) -> None:
    """Code after the loop (saving the model) runs to its end within `finish_grace`; an exception
    there, or code still running when the grace is out, makes the job not ok, with the rank named
    (before, a rank was stopped 10 s after training finished whatever it did, and its exit code was
    never read)."""
    script = tmp_path / "after_loop.py"
    script.write_text(AFTER_LOOP)
    grace = 2.0 if mode == "forever" else 20.0
    job = spec(
        tmp_path,
        f"after-loop-{mode}",
        script=script,
        args=(mode, str(tmp_path)),
        nproc=2,
        spares=0,
        finish_grace=grace,
    )
    result = await asyncio.wait_for(run_job(job, client), 90)
    assert result.steps_completed == 5, result
    if mode == "slow":
        assert result.ok, result.error
        assert sorted(p.name for p in tmp_path.glob("saved-*")) == ["saved-0", "saved-1"]
    elif mode == "raise":
        assert result.status is JobState.USER_ERROR and result.error, result
        assert "rank 1 exited (exit code 1) after the training loop" in result.error, result.error
    else:
        assert result.status is JobState.USER_ERROR and result.error, result
        assert "rank 0 was still running its code after the training loop" in result.error, (
            result.error
        )


async def test_an_idle_spare_waits_as_long_as_the_job_runs(
    client: Client, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A warm spare with nothing to do outlives the recovery timeout (2 s here, for a 300-step job):
    it is never timed out and respawned, so the pool is never empty for a moment."""
    job = spec(
        tmp_path, "idle-spare", args=("--steps", "300", "--width", "64"), recovery_timeout=2.0
    )
    result = await asyncio.wait_for(run_job(job, client), 150)
    assert result.ok and not result.incidents
    assert "RecoveryTimeout" not in capfd.readouterr().err


def test_a_corrupted_secret_and_a_missing_tls_file_are_named_without_a_traceback(
    tmp_path: Path,
) -> None:
    """A job whose secret file was damaged (here: not hex) and a TLS file that is not there: each
    command says which file and why, exit code 2, and no traceback (a script or monitor reads
    stderr)."""
    job_dir = tmp_path / "jobs" / "damaged"
    job_dir.mkdir(parents=True)
    # Registered as running: this test's own process stands in for its coordinator.
    info = {"job_id": "damaged", "pid": os.getpid(), "coordinator": "127.0.0.1:9"}
    (job_dir / "job.json").write_text(json.dumps(info))
    (job_dir / "secret").write_text("this is not a hex secret")
    env = {"TORCHPASS_STATE_DIR": str(tmp_path), "PATH": ""}
    out = _cli("inject", "kill", "--job", "damaged", "--rank", "1", env=env)
    assert out.returncode == 2, out
    assert (
        "its secret" in out.stderr
        and "cannot be read" in out.stderr
        and "Traceback" not in out.stderr
    )
    missing = tmp_path / "missing.pem"
    out = _cli("incidents", "list", "--tls-ca", str(missing), env=env)
    assert out.returncode == 2, out
    assert "no such file" in out.stderr and "Traceback" not in out.stderr
