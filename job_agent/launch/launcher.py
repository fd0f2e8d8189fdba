"""Starting, signalling and reaping a job's processes. The local launcher runs them on this host."""

from __future__ import annotations

import abc
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from datetime import timedelta

from job_agent.launch.forkserver import Forked, ForkServer
from torchpass.job import JobSpec


def agent_env(
    spec: JobSpec,
    agent_id: str,
    role: str,
    slot: int,
    coordinator: str,
    store: str,
    restore: str | None = None,
    launch: tuple[int, int] = (0, 0),
) -> dict[str, str]:
    """The TORCHPASS_* variables a rank or spare reads its `AgentSettings` from; for a job without
    the agent, torchrun's too (`launch`: the restart count and the port its rank 0 serves the
    group's store on)."""
    env = {
        "TORCHPASS_JOB_ID": spec.job_id,
        "TORCHPASS_AGENT_ID": agent_id,
        "TORCHPASS_ROLE": role,
        "TORCHPASS_SLOT": str(slot),
        "TORCHPASS_WORLD_SIZE": str(spec.nproc),
        "TORCHPASS_COORDINATOR": coordinator,
        "TORCHPASS_ADVERTISE_HOST": spec.host,  # a node agent gives its own
        "TORCHPASS_STORE": store,
        "TORCHPASS_SECRET_FILE": str(spec.job_dir / "secret"),
        "TORCHPASS_CHECKPOINT_DIR": str(spec.job_dir / "checkpoints"),
        "TORCHPASS_CHECKPOINT_EVERY": str(spec.checkpoint_every),
        "TORCHPASS_VERIFY_EVERY": str(spec.verify_every),
        "TORCHPASS_KEEP_CHECKPOINTS": str(spec.keep_checkpoints),
        "TORCHPASS_SEED": str(spec.seed),
        "TORCHPASS_THREADS": str(spec.threads),
        "TORCHPASS_COLLECTIVE_TIMEOUT": str(spec.collective_timeout),
        "TORCHPASS_RECOVERY_TIMEOUT": str(spec.recovery_timeout),
    }
    if restore:
        env["TORCHPASS_RESTORE"] = restore
    env |= torchrun_env(spec, slot, *launch) if not spec.agent else agent_torchrun_env(spec, slot)
    return env


def agent_torchrun_env(spec: JobSpec, slot: int) -> dict[str, str]:
    """What torchrun gives each worker, as far as it holds under the agent, for the libraries that
    read it (accelerate decides from it that the job is distributed): the world's size and each
    rank's own rank. A warm spare has no rank until it takes a slot, so it has no RANK (the agent
    sets it then). No MASTER_PORT: the agent forms the group itself (`RankAgent()` first)."""
    n = str(spec.nproc)
    per_node = str(max(1, spec.nproc // max(1, spec.nodes)))
    env = {
        "WORLD_SIZE": n,
        "ROLE_WORLD_SIZE": n,
        "LOCAL_WORLD_SIZE": per_node,
        "ROLE_NAME": "default",
        "MASTER_ADDR": spec.host,
        "TORCHELASTIC_RUN_ID": spec.job_id,
    }
    if slot >= 0:
        env |= {"RANK": str(slot), "ROLE_RANK": str(slot)}
    return env


def torchrun_env(spec: JobSpec, rank: int, restarts: int, port: int) -> dict[str, str]:
    """What torchrun gives each worker, for a script that forms its own group
    (`init_process_group()`)."""
    n = str(spec.nproc)
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "WORLD_SIZE": n,
        "LOCAL_WORLD_SIZE": n,
        "ROLE_WORLD_SIZE": n,
        "MASTER_ADDR": spec.host,
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": spec.job_id,
        "TORCHELASTIC_RESTART_COUNT": str(restarts),
        "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
        "TORCHELASTIC_USE_AGENT_STORE": "False",
    }


def command(spec: JobSpec) -> tuple[str, tuple[str, ...]]:
    """The script and arguments each rank runs: the script itself, or, without the agent, the script
    under `job_agent.rank.unmodified` (which reports its steps and exit)."""
    if spec.agent:
        return str(spec.script), spec.args
    return "-m", ("job_agent.rank.unmodified", str(spec.script), *spec.args)


def signal_name(code: int) -> str:
    """A process's exit status in words: its exit code, or the signal that ended it."""
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"exit code {code}"


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class Launcher(abc.ABC):
    """Where rank and spare processes run: this host, a Kubernetes pod, a Slurm step."""

    @abc.abstractmethod
    def spawn(self, agent_id: str, env: Mapping[str, str]) -> str:
        """Start a process running the training script; returns its failure domain (node)."""

    @abc.abstractmethod
    def kill(self, agent_id: str) -> None:
        """Fence: kill the process for good (idempotent, also when it is stopped)."""

    @abc.abstractmethod
    def suspend(self, agent_id: str) -> None:
        """Stop the process without killing it (failure injection of a hang)."""

    @abc.abstractmethod
    def resume(self, agent_id: str) -> None:
        """Continue a suspended process (failure injection of a stall that ends)."""

    @abc.abstractmethod
    def poll(self, agent_id: str) -> int | None:
        """Exit code if the process has ended, else None."""

    @abc.abstractmethod
    def pid(self, agent_id: str) -> int | None: ...

    @abc.abstractmethod
    def shutdown(self, timeout: timedelta) -> None:
        """Stop every process still running, waiting at most `timeout` seconds before killing."""


def inherited_env(env: Mapping[str, str]) -> dict[str, str]:
    """What a rank inherits from the coordinator's environment: everything the user's script may
    need (PATH, PYTHONPATH, CUDA_*, its own variables), none of torchpass's own settings. Those hold
    the coordinator's secrets (the Temporal API key and TLS key, the billing webhook's secret); a
    rank gets exactly its `agent_env` instead."""
    return {k: v for k, v in env.items() if not k.startswith("TORCHPASS_")}


def die_with_parent() -> list[str]:
    """A prefix that has the kernel SIGKILL a rank when the thread that started it ends, so that a
    coordinator killed (SIGKILL, OOM) leaves no rank behind, a stopped (hung) one included:
    util-linux's `setpriv --pdeathsig` (preexec_fn would do it too, but is unsafe in a process with
    threads). Empty where there is no setpriv (not Linux): ranks then outlive a killed coordinator
    until their control connection closes."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--"] if setpriv and sys.platform == "linux" else []


class LocalLauncher(Launcher):
    """Processes on this host; each is its own failure domain, named host/agent. Started from the
    main thread, each dies with the coordinator (`die_with_parent`). Each gets its own GPU: its
    LOCAL_RANK is the lowest index no live process of this launcher holds (a spare that takes a slot
    keeps its own)."""

    def __init__(
        self,
        script: str,
        args: Sequence[str],
        base_env: Mapping[str, str] | None = None,
        fork: bool | None = None,
    ) -> None:
        self._argv = [script, *args]
        self._reaper = die_with_parent()
        self._base_env = inherited_env(os.environ if base_env is None else base_env)
        self._procs: dict[str, subprocess.Popen[bytes] | Forked] = {}
        self._devices: dict[str, int] = {}  # agent -> the LOCAL_RANK it was started with
        self._host = socket.gethostname()
        self._lock = threading.Lock()  # spawn runs on the coordinator's loop, shutdown in a thread
        self._closed = False
        # Forked from a warm interpreter (`job_agent.launch.forkserver`), started now so that it
        # imports while the job sets up; from the main thread only (the death signal follows the
        # starting thread).
        if fork is None:
            fork = os.environ.get("TORCHPASS_FORK_SERVER", "1") != "0" and sys.platform == "linux"
        main = threading.current_thread() is threading.main_thread()
        self._server = ForkServer.shared(self._reaper, self._base_env) if fork and main else None

    def spawn(self, agent_id: str, env: Mapping[str, str]) -> str:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"not starting {agent_id}: the job is shutting down")
            device = int(env["LOCAL_RANK"]) if "LOCAL_RANK" in env else self.free_devices(1)[0]
            full_env = {**self._base_env, **env, "LOCAL_RANK": str(device)}
            main = threading.current_thread() is threading.main_thread()
            if self._server is not None and self._server.gone and main:  # stopped idle, or died
                self._server = ForkServer.shared(self._reaper, self._base_env)
            if self._server is not None:
                self._procs[agent_id] = self._server.start(agent_id, self._argv, full_env)
            else:
                # The death signal follows the starting thread: from any other, a rank would die
                # with it.
                cmd = [sys.executable, "-u", *self._argv]
                self._procs[agent_id] = subprocess.Popen(
                    [*self._reaper, *cmd] if main else cmd, env=full_env
                )
            self._devices[agent_id] = device
        return f"{self._host}/{agent_id}"

    def devices(self) -> dict[str, int]:
        """The LOCAL_RANK of each live process."""
        return {a: d for a, d in list(self._devices.items()) if self.poll(a) is None}

    def free_devices(self, count: int) -> list[int]:
        """The `count` lowest LOCAL_RANKs no live process holds."""
        used = set(self.devices().values())
        return [i for i in range(len(used) + count) if i not in used][:count]

    def _signal(self, agent_id: str, sig: signal.Signals) -> None:
        proc = self._procs.get(agent_id)
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it exited in between
                proc.send_signal(sig)

    def kill(self, agent_id: str) -> None:
        self._signal(agent_id, signal.SIGKILL)

    def suspend(self, agent_id: str) -> None:
        self._signal(agent_id, signal.SIGSTOP)

    def resume(self, agent_id: str) -> None:
        self._signal(agent_id, signal.SIGCONT)

    def poll(self, agent_id: str) -> int | None:
        proc = self._procs.get(agent_id)
        return None if proc is None else proc.poll()

    def pid(self, agent_id: str) -> int | None:
        proc = self._procs.get(agent_id)
        return None if proc is None else proc.pid

    def wait(self, agent_id: str) -> int:
        """Block until the process ends; its exit code (negative: the signal that ended it)."""
        return self._procs[agent_id].wait()

    def shutdown(self, timeout: timedelta) -> None:
        with self._lock:  # no process starts after this: every one is in the list below
            self._closed = True
            procs = list(self._procs.values())
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                # a suspended process acts on SIGTERM only once resumed
                proc.send_signal(signal.SIGCONT)
        for proc in procs:
            try:
                proc.wait(timeout.total_seconds())
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
