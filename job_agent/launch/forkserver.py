"""Rank and spare processes forked from a warm interpreter instead of started cold.

A cold rank spends most of its start importing: torch itself, and torch._dynamo, which the first
optimizer a script builds imports (measured on these 2-core machines: about 4 of the 4.5 CPU-seconds
from exec to a rank ready to train). The fork server imports them once; each process it starts is a
fork of it that then runs the script as `python -u SCRIPT ARGS` (or `python -u -m MODULE ARGS`)
would, its own environment, its own `sys.argv`, `sys.path[0]` the script's directory, stdin from
/dev/null, and an ordinary interpreter exit (atexit handlers, non-daemon threads joined, its exit
code). A restart from a checkpoint and a spare replacing a lost one start in a fraction of a second.

Nothing here initialises CUDA, seeds or draws from a random stream, starts a thread pool or forms a
process group before the fork: a child starts as a fresh process would. Python's `random` is
reseeded in each child by Python itself, numpy's global generator (imported with torch) here.

The protocol, one JSON object per line:
- launcher -> server (the server's stdin): `{"id", "argv", "env"}`: start a process; EOF (the
  launcher's process ended): stop, once its children have;
- server -> launcher (the descriptor given as the first argument): `{"id", "pid"}` once forked,
  `{"id", "code"}` when it ended (its exit status, or minus the signal that ended it, as `Popen`
  says).

Run as `python -u -m job_agent.launch.forkserver EVENTS_FD [--pdeathsig]`: with `--pdeathsig` each
child is SIGKILLed by the kernel when the server dies (the server itself dies with its launcher's
thread).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import IO, Any

import setproctitle

# What a rank imports before its first step (`torch.distributed.checkpoint` is left out: the
# unmodified runner watches for its import).
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torch.optim", "job_agent.rank.agent")
MAX_REQUEST = 1 << 20
_PR_SET_PDEATHSIG = 1


class Forked:
    """A process the fork server started: what a launcher uses of a `subprocess.Popen`."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._ended = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:  # never a pid the server has reaped (and the kernel may reuse)
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def ended(self, code: int) -> None:
        self.returncode = code
        self._ended.set()


class ForkServer:
    """The launcher's side: starts the server (importing in the background), forks a process per
    `start`. A server that died or never came up fails `start` with RuntimeError."""

    START_TIMEOUT = 120.0  # its imports, on a loaded machine
    _shared: dict[tuple[tuple[str, ...], frozenset[tuple[str, str]]], ForkServer] = {}
    _shared_lock = threading.Lock()

    @classmethod
    def shared(cls, prefix: Sequence[str], env: Mapping[str, str]) -> ForkServer:
        """This process's server for `prefix` and `env` (started now if there is none or it
        stopped): a second job run by the same process (the tests run hundreds) forks from the same
        warm server. The servers of other environments with nothing running are stopped: each holds
        its own torch (about 370 MB), and a process whose environment keeps changing (pytest names
        the test in it) once kept one per test until it ran out of memory."""
        key = (tuple(prefix), frozenset(env.items()))
        with cls._shared_lock:
            for other_key, other in list(cls._shared.items()):
                if other_key != key and other.stop_if_idle():
                    del cls._shared[other_key]
            server = cls._shared.get(key)
            if server is None or server._gone:
                server = cls._shared[key] = cls(prefix, env)
            return server

    @property
    def gone(self) -> bool:
        return self._gone

    def stop_if_idle(self) -> bool:
        """Stop the server if no process it forked runs and none is being started; whether it is
        stopped."""
        with self._lock:
            if self._procs or self._started:
                return False
            self._gone = True  # `start` refuses from now on
            stdin = self._proc.stdin
        if stdin is not None:
            with contextlib.suppress(OSError):
                stdin.close()  # its end of input: it exits, having no child to wait for
        return True

    def __init__(self, prefix: Sequence[str], env: Mapping[str, str]) -> None:
        r, w = os.pipe()
        cmd = [*prefix, sys.executable, "-u", "-m", "job_agent.launch.forkserver", str(w)]
        self._proc = subprocess.Popen(
            [*cmd, "--pdeathsig"] if prefix else cmd,
            stdin=subprocess.PIPE,
            pass_fds=(w,),
            env=dict(env),
        )
        os.close(w)
        self._events: IO[bytes] = os.fdopen(r, "rb")
        self._lock = threading.Lock()
        self._started: dict[str, threading.Event] = {}
        self._born: dict[str, Forked] = {}  # forked, not yet taken by `start`
        # running, by request id: agent ids repeat from job to job
        self._procs: dict[str, Forked] = {}
        self._requests = 0
        self._gone = False
        threading.Thread(target=self._read, name="torchpass-forkserver", daemon=True).start()

    def start(self, agent_id: str, argv: Sequence[str], env: Mapping[str, str]) -> Forked:
        started = threading.Event()
        with self._lock:
            if self._gone:
                raise RuntimeError("the fork server has stopped")
            self._requests += 1
            rid = f"{self._requests}:{agent_id}"
            self._started[rid] = started
            request = json.dumps({"id": rid, "argv": list(argv), "env": dict(env)}) + "\n"
            stdin = self._proc.stdin
            assert stdin is not None
            try:
                stdin.write(request.encode())
                stdin.flush()
            except OSError as e:
                raise RuntimeError(f"the fork server has stopped: {e}") from None
        started.wait(self.START_TIMEOUT)
        with self._lock:
            del self._started[rid]
            proc = self._born.pop(rid, None)
        if proc is None:
            raise RuntimeError(f"the fork server did not start {agent_id}")
        return proc

    def _read(self) -> None:
        for line in self._events:
            event = json.loads(line)
            agent = event["id"]
            if "pid" in event:
                with self._lock:
                    self._procs[agent] = proc = Forked(int(event["pid"]))
                    if agent in self._started:
                        self._born[agent] = proc
                        self._started[agent].set()
                    else:  # `start` gave up on it: nobody would ever stop it
                        proc.kill()
            elif (ended := self._procs.pop(agent, None)) is not None:
                # perhaps before `start` took it: it is the same object
                ended.ended(int(event["code"]))
        with self._lock:  # the server is gone: so are its children (their death signal), or soon
            self._gone = True
            for event in self._started.values():
                event.set()
        self._proc.wait()
        for proc in self._procs.values():
            if proc.returncode is None:  # its server died unreaped: what it had started dies too
                with contextlib.suppress(OSError):
                    os.kill(proc.pid, signal.SIGKILL)
                proc.ended(-signal.SIGKILL)


def serve(events: int, pdeathsig: bool) -> dict[str, Any] | None:
    """Fork a child for each request until stdin closes and every child has ended (None). In a
    child, returns its request."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    # A terminal's Ctrl-C reaches the whole process group: the job's processes act on it, the server
    # goes on until its launcher's process has ended.
    signal.signal(signal.SIGINT, lambda *_: None)
    children: dict[int, str] = {}
    buf, reading = b"", True
    while reading or children:
        ready, _, _ = select.select([0, wake_r] if reading else [wake_r], [], [], 1.0)
        if wake_r in ready:
            os.read(wake_r, 4096)
        _reap(children, events)
        if 0 not in ready:
            continue
        data = os.read(0, 65536)
        if not data:
            reading = False
            continue
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.default_int_handler)
                for fd in (wake_r, wake_w, events):
                    os.close(fd)
                _child_setup(pdeathsig)
                return dict(request)
            children[pid] = request["id"]
            _say(events, {"id": request["id"], "pid": pid})
        if len(buf) > MAX_REQUEST:
            raise SystemExit("a request over 1 MiB: not from a launcher")
    return None


def _reap(children: dict[int, str], events: int) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        agent = children.pop(pid, None)
        if agent is not None:
            _say(events, {"id": agent, "code": os.waitstatus_to_exitcode(status)})


def _say(events: int, what: dict[str, Any]) -> None:
    line = (json.dumps(what) + "\n").encode()
    view = memoryview(line)
    while view:
        try:
            view = view[os.write(events, view) :]
        except BrokenPipeError:
            return  # the launcher is gone; its children are being stopped


def _child_setup(pdeathsig: bool) -> None:
    if pdeathsig:
        parent = os.getppid()
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the server died before the death signal was set
            os._exit(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()  # as a fresh process seeds it


def become(request: dict[str, Any]) -> None:
    """Run the request's program in this (forked) process, as the interpreter would run it. Its
    command line (`ps`, /proc/PID/cmdline) is the one it would have had, and says which job and
    process it is (its environment in /proc stays the server's: the kernel shows the one a process
    was exec'd with)."""
    os.environ.clear()
    os.environ.update(request["env"])
    argv = list(request["argv"])
    env = request["env"]
    who = f" [torchpass {env.get('TORCHPASS_JOB_ID', '?')}/{env.get('TORCHPASS_AGENT_ID', '?')}]"
    setproctitle.setproctitle(" ".join([sys.executable, "-u", *argv]) + who)
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


def main(args: list[str]) -> None:
    events, pdeathsig = int(args[0]), "--pdeathsig" in args[1:]
    for name in PRELOAD:
        importlib.import_module(name)
    # Claims the command line's memory now: a child that set its environment first could not.
    setproctitle.setproctitle(setproctitle.getproctitle())
    request = serve(events, pdeathsig)
    if request is not None:
        become(request)


if __name__ == "__main__":
    main(sys.argv[1:])
