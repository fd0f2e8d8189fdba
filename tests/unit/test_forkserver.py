"""The fork server (`job_agent.launch.forkserver`): a real server process, real forks. What a forked
process sees is what `python -u SCRIPT ARGS` would give it (its argv, its script's directory first
on the path, its own environment and nothing of the server's, stdin empty), its exit code is the
interpreter's, and a signal that ends it is reported as `Popen` reports one."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

from job_agent.launch.forkserver import ForkServer
from tests.unit.job_driver import poll_until

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the fork server is Linux-only")


@pytest.fixture(scope="module")
def server() -> ForkServer:
    return ForkServer((), {"PATH": os.environ.get("PATH", ""), "SERVER_ONLY": "x"})


def test_a_forked_script_sees_what_python_script_would(server: ForkServer, tmp_path: Path) -> None:
    out = tmp_path / "seen.json"
    script = tmp_path / "dump.py"
    script.write_text(
        "import json, os, sys\n"
        "cmd = open('/proc/self/cmdline', 'rb').read().rstrip(b'\\0').decode()\n"
        f"json.dump({{'argv': sys.argv, 'path0': sys.path[0], 'env': dict(os.environ),"
        f" 'stdin': sys.stdin.read(), 'main': __name__, 'cmd': cmd}}, open({str(out)!r}, 'w'))\n"
    )
    env = {"MINE": "1", "TORCHPASS_JOB_ID": "j1", "TORCHPASS_AGENT_ID": "rank0-1"}
    proc = server.start("rank0-1", [str(script), "--steps", "3"], env)
    assert proc.wait(60) == 0
    seen = json.loads(out.read_text())
    assert seen["argv"] == [str(script), "--steps", "3"] and seen["path0"] == str(tmp_path)
    assert seen["env"] == env and seen["stdin"] == "" and seen["main"] == "__main__"
    # What `ps` shows: the command it would have run, and which job's process it is.
    assert seen["cmd"] == f"{sys.executable} -u {script} --steps 3 [torchpass j1/rank0-1]"


def test_a_module_runs_as_python_m_would(server: ForkServer, tmp_path: Path) -> None:
    out = tmp_path / "argv.json"
    proc = server.start(
        "rank0-2", ["-m", "json.tool", "--no-ensure-ascii", os.devnull, str(out)], {"A": "b"}
    )
    assert proc.wait(60) == 1  # json.tool on an empty file: its own error, its own exit code
    assert proc.poll() == 1


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ("pass", 0),
        ("raise SystemExit(3)", 3),
        ("raise ValueError('bug')", 1),
        ("import os; os._exit(7)", 7),
    ],
)
def test_exit_codes_are_the_interpreters(
    server: ForkServer, tmp_path: Path, body: str, code: int
) -> None:
    script = tmp_path / "end.py"
    script.write_text(body + "\n")
    assert server.start("rank0-3", [str(script)], {}).wait(60) == code


def test_a_signal_that_ends_it_is_reported_negative_and_ids_may_repeat(
    server: ForkServer, tmp_path: Path
) -> None:
    script = tmp_path / "sleep.py"
    script.write_text("import time\ntime.sleep(60)\n")
    first = server.start("spare-1", [str(script)], {})
    second = server.start("spare-1", [str(script)], {})  # the same agent id, as the next job's
    assert first.pid != second.pid and first.poll() is None
    first.send_signal(signal.SIGSTOP)
    first.kill()
    second.terminate()
    assert first.wait(30) == -signal.SIGKILL and second.wait(30) == -signal.SIGTERM
    first.kill()  # reaped: nothing is sent to a pid the kernel may have given to another process
    marked, started = tmp_path / "marked.py", tmp_path / "started"
    marked.write_text(
        f"import pathlib, time\npathlib.Path({str(started)!r}).touch()\ntime.sleep(60)\n"
    )
    ctrl_c = server.start("rank0-1", [str(marked)], {})
    poll_until(started.exists, "the forked script to start", timeout=30)
    # the server ignores a Ctrl-C; what it forks acts on it as python does
    ctrl_c.send_signal(signal.SIGINT)
    assert ctrl_c.wait(30) == -signal.SIGINT


def test_forked_processes_do_not_share_a_random_stream(server: ForkServer, tmp_path: Path) -> None:
    draws = []
    for i in range(2):
        out = tmp_path / f"draw{i}"
        script = tmp_path / "draw.py"
        script.write_text(
            "import random, numpy\n"
            f"open({str(out)!r}, 'w').write(f'{{random.random()}} {{numpy.random.rand()}}')\n"
        )
        assert server.start(f"rank{i}-1", [str(script)], {}).wait(60) == 0
        draws.append(out.read_text().split())
    assert draws[0][0] != draws[1][0] and draws[0][1] != draws[1][1]


def test_a_server_of_another_environment_is_stopped_once_idle(tmp_path: Path) -> None:
    """A process whose environment changes from job to job (pytest names the running test in it)
    once kept a warm server, its own torch included, for each: the one of another environment is
    stopped when nothing it forked runs, and kept while something does."""
    base = {"PATH": os.environ.get("PATH", "")}
    script = tmp_path / "wait.py"
    script.write_text("import time\ntime.sleep(60)\n")
    first = ForkServer.shared((), {**base, "JOB": "1"})
    busy = first.start("rank0-1", [str(script)], {})
    second = ForkServer.shared((), {**base, "JOB": "2"})
    assert not first.gone and second is not first  # its process still runs: kept
    busy.kill()
    assert busy.wait(30) == -signal.SIGKILL
    poll_until(lambda: not first._procs, "the first server to say its process ended", timeout=30)
    third = ForkServer.shared((), {**base, "JOB": "3"})
    assert first.gone and second.gone and not third.gone
    # they exited, having nothing to wait for
    assert first._proc.wait(30) == 0 and second._proc.wait(30) == 0
    with pytest.raises(RuntimeError, match="stopped"):
        first.start("rank0-2", [str(script)], {})
    assert ForkServer.shared((), {**base, "JOB": "1"}) is not first  # asked again: a fresh one
