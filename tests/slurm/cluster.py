"""A real Slurm cluster on one machine, started by tests.

Everything is real: a private `munged` (own key and socket), a real `slurmctld` and one real `slurmd
-N nodeX` per node, all Debian's slurm-wlm 22.05 binaries, talking over 127.0.0.1 on free ports
picked at start. Jobs run for real through `sbatch`/`srun` (several slurmd on one host share the
machine's cores; each node claims `cpus` CPUs through `SlurmdParameters=config_overrides`). Config,
key, sockets, spool, state, logs and pid files all live under the `root` given (a pytest tmp dir),
so concurrent sessions cannot clash.

    with SlurmCluster(tmp_path) as cluster:
        cluster.drain("node2", "xid 79")
        assert cluster.node_states()["node2"].flags == ("DRAIN",)

Run `tests/slurm/install.sh` (or call `available()`) to install slurm-wlm and munge where they are
missing.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

from tests.slurm.conf import SlurmConfig, render_config

INSTALL = Path(__file__).with_name("install.sh")
# The daemons live in /usr/sbin, which a non-root PATH may lack.
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "slurmstepd")
CLIENTS = ("scontrol", "sinfo", "squeue", "sbatch", "srun", "scancel")
START_TIMEOUT = 20.0
SLURM_ENV_PREFIXES = ("SLURM_", "SBATCH_", "SALLOC_", "SRUN_", "SLURMD_")
# A unix socket path must fit in 108 bytes; slurmd puts `<node>_<job>.<step>` sockets in its spool
# dir.
MAX_ROOT_LEN = 60


def which(name: str) -> str | None:
    return shutil.which(name, path=SEARCH_PATH)


_install_tried: list[str] = []


def available(install: bool = True) -> str | None:
    """None when a real Slurm cluster can run here, else why not (for `pytest.skip`).

    Runs `install.sh` once per process when the binaries are missing and we are root.
    """
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "not root: slurmd must run as root to launch job steps"
    missing = [n for n in DAEMONS + CLIENTS if which(n) is None]
    if missing and install and not _install_tried:
        done = subprocess.run(
            ["bash", str(INSTALL)], capture_output=True, text=True, timeout=600, check=False
        )
        _install_tried.append((done.stdout + done.stderr)[-2000:])
        missing = [n for n in DAEMONS + CLIENTS if which(n) is None]
    if missing:
        log = f"; install.sh said: {_install_tried[0]}" if _install_tried else ""
        return f"Slurm binaries missing: {', '.join(missing)}{log}"
    return None


class SlurmCommandError(subprocess.CalledProcessError):
    """A Slurm client command failed; its message carries stderr (CalledProcessError's does not)."""

    def __str__(self) -> str:
        return f"{super().__str__()}\nstdout: {self.stdout}\nstderr: {self.stderr}"


class SlurmStartError(RuntimeError):
    """The cluster did not come up; the message carries the daemons' log tails."""


@dataclass(frozen=True)
class NodeState:
    """One node as `sinfo --json` reports it: base state (`IDLE`, `DOWN`...), flags (`DRAIN`...),
    reason."""

    state: str
    flags: tuple[str, ...]
    reason: str

    @property
    def drained(self) -> bool:
        return "DRAIN" in self.flags


def free_ports(count: int) -> list[int]:
    """Distinct free TCP ports on 127.0.0.1 (all held open while choosing, so none repeats)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class SlurmCluster:
    """A real slurmctld + one real slurmd per node + a private munged, all under `root`."""

    def __init__(
        self,
        root: Path,
        nodes: int = 3,
        partition: str = "train",
        spare_partition: str | None = "spares",
        spare_nodes: int = 1,
        prolog: Path | None = None,
        epilog: Path | None = None,
        prolog_flags: str | None = "Alloc",
        cpus: int = 4,
        real_memory_mb: int = 1000,
    ) -> None:
        self.root = Path(root).resolve()
        self.nodes = [f"node{i}" for i in range(1, nodes + 1)]
        self.spares = [f"spare{i}" for i in range(1, spare_nodes + 1)] if spare_partition else []
        self.partition = partition
        self.spare_partition = spare_partition
        self.prolog = prolog
        self.epilog = epilog
        self.prolog_flags = prolog_flags
        self.cpus = cpus
        self.real_memory_mb = real_memory_mb
        # Names the cluster's state files and marks its daemons' environment (see `processes`).
        self.name = f"tp{uuid.uuid4().hex[:10]}"
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._link: Path | None = None
        self.base = self.root  # the path written into slurm.conf: `root` or a short link to it

    # -- paths ---------------------------------------------------------------------------------

    @property
    def conf(self) -> Path:
        return self.base / "etc" / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.base / "munge" / "munge.socket"

    @property
    def all_nodes(self) -> list[str]:
        return self.nodes + self.spares

    @property
    def env(self) -> dict[str, str]:
        """Environment for Slurm clients: merge into os.environ for subprocesses.

        The munge socket reaches clients through `AuthInfo=socket=...` in slurm.conf, so
        `SLURM_CONF` is all they need; `MUNGE_SOCKET` is for scripts calling `munge -S
        "$MUNGE_SOCKET"` themselves.
        """
        return {"SLURM_CONF": str(self.conf), "MUNGE_SOCKET": str(self.munge_socket)}

    def client_env(self) -> dict[str, str]:
        """os.environ without any outer job's SLURM_*/SBATCH_* settings, plus `env`."""
        outer = {k: v for k, v in os.environ.items() if not k.startswith(SLURM_ENV_PREFIXES)}
        return {**outer, "PATH": SEARCH_PATH, **self.env}

    def _daemon_env(self) -> dict[str, str]:
        return {**self.client_env(), "TORCHPASS_SLURM_CLUSTER": self.name}

    # -- lifecycle -----------------------------------------------------------------------------

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        """Start munged, slurmctld and every slurmd; return once `sinfo` shows every node idle.

        On failure everything started is stopped and SlurmStartError carries the daemons' log tails.
        A port taken between choosing it and binding it (another session's client, say) gets one
        retry.
        """
        reason = available()
        if reason:
            raise SlurmStartError(reason)
        for attempt in (1, 2):
            try:
                self._start_daemons(time.monotonic() + START_TIMEOUT)
                break
            except BaseException as e:
                logs = self.log_tails()
                self.stop()
                if not isinstance(e, SlurmStartError | subprocess.SubprocessError | OSError):
                    raise
                if attempt == 1 and "Address already in use" in logs:
                    continue
                raise SlurmStartError(f"{e}\n{logs}") from e

    def _start_daemons(self, deadline: float) -> None:
        self._layout()
        self._start_munge()
        self._spawn(
            "slurmctld", [which("slurmctld") or "slurmctld", "-D", "-c", "-f", str(self.conf)]
        )
        for node in self.all_nodes:
            self._spawn(
                f"slurmd-{node}",
                [which("slurmd") or "slurmd", "-D", "-N", node, "-f", str(self.conf)],
            )
        self._wait_idle(deadline)

    def _layout(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        if len(str(self.root)) > MAX_ROOT_LEN:
            self._link = Path(tempfile.mkdtemp(prefix="slurm-", dir="/tmp")) / "r"
            self._link.symlink_to(self.root)
            self.base = self._link
        for sub in ("etc", "munge", "state", "spool", "log", "run", "jobs"):
            (self.root / sub).mkdir(exist_ok=True)
        for node in self.all_nodes:  # slurmd wants its spool dir (its step sockets' dir) to exist
            (self.root / "spool" / node).mkdir(exist_ok=True)
        ctld_port, *node_ports = free_ports(1 + len(self.all_nodes))
        partitions = {self.partition: self.nodes}
        if self.spare_partition and self.spares:
            partitions[self.spare_partition] = self.spares
        config = SlurmConfig(
            cluster=self.name,
            host=socket.gethostname().split(".")[0],
            base=self.base,
            ctld_port=ctld_port,
            partitions=partitions,
            node_ports=dict(zip(self.all_nodes, node_ports, strict=True)),
            cpus=self.cpus,
            real_memory_mb=self.real_memory_mb,
            prolog=self.prolog,
            epilog=self.epilog,
            prolog_flags=self.prolog_flags,
        )
        (self.root / "etc" / "slurm.conf").write_text(render_config(config))

    def _start_munge(self) -> None:
        key = self.base / "munge" / "munge.key"
        if not key.exists():
            subprocess.run(
                [which("mungekey") or "mungekey", "-c", "-k", str(key)], check=True, timeout=10
            )
        # As root with --force: pytest's tmp dirs are root-only (0700), which the munge user cannot
        # reach, and munged refuses a socket in a dir others cannot enter ("Socket is inaccessible")
        # without it.
        argv = [which("munged") or "munged", "-F", "--force", "-S", str(self.munge_socket)]
        argv += ["--key-file", str(key), "--seed-file", str(self.base / "munge" / "munged.seed")]
        argv += ["--log-file", str(self.base / "log" / "munged.log"), "--num-threads", "4"]
        argv += ["--pid-file", str(self.base / "run" / "munged.pid")]
        self._spawn("munged", argv)
        deadline = time.monotonic() + 5
        while not self.munge_socket.exists():
            if self._procs["munged"].poll() is not None or time.monotonic() > deadline:
                raise SlurmStartError("munged did not create its socket")
            time.sleep(0.02)

    def _spawn(self, name: str, argv: list[str]) -> None:
        out = open(self.root / "log" / f"{name}.out", "ab")  # noqa: SIM115 - the child owns it
        with out:
            self._procs[name] = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self._daemon_env(),
                start_new_session=True,
                cwd=self.root,  # prolog/epilog inherit slurmd's cwd
            )

    def _wait_idle(self, deadline: float) -> None:
        last = ""
        while time.monotonic() < deadline:
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    raise SlurmStartError(f"{name} exited with {proc.returncode}")
            # Short timeout: a client talking to a port someone else holds hangs instead of failing.
            try:
                done = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False, timeout=3)
            except subprocess.TimeoutExpired:
                continue
            last = done.stdout + done.stderr
            states = dict(line.split() for line in done.stdout.splitlines() if line.strip())
            if done.returncode == 0 and all(states.get(n) == "idle" for n in self.all_nodes):
                return
            time.sleep(0.05)
        raise SlurmStartError(f"nodes not idle after {START_TIMEOUT} s; last sinfo:\n{last}")

    def stop(self) -> None:
        """Cancel jobs, `scontrol shutdown`, then kill whatever is left (job steps and munged
        included).

        Safe to call twice and after a start that failed half-way.
        """
        ctld = self._procs.get("slurmctld")
        if ctld is not None and ctld.poll() is None:
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                self._cancel_all_jobs()
                self.run("scontrol", "shutdown", check=False)
            deadline = time.monotonic() + 5
            for name, proc in self._procs.items():
                if name != "munged":
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(max(0.0, deadline - time.monotonic()))
        for proc in self._procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(5)
        self._procs.clear()
        self._kill_leftovers()
        if self._link is not None:
            shutil.rmtree(self._link.parent, ignore_errors=True)
            self._link = None

    def _cancel_all_jobs(self, timeout: float = 10) -> None:
        """scancel every job and wait (bounded) until squeue lists none, so steps end through
        Slurm."""
        self.run("scancel", "--full", "--quiet", f"--user={os.getuid()}", check=False)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            done = self.run("squeue", "-h", "-o", "%i", check=False)
            if done.returncode != 0 or not done.stdout.strip():
                return
            time.sleep(0.1)

    def processes(self) -> list[int]:
        """Pids of this cluster's live processes: daemons, slurmstepd, job tasks, prologs and
        epilogs.

        Daemons carry TORCHPASS_SLURM_CLUSTER=<name> (slurmstepd inherits it); job tasks, prologs
        and epilogs carry this cluster's SLURM_CONF and a SLURM_JOB_ID. Clients started by tests do
        not count.
        """
        daemon = f"TORCHPASS_SLURM_CLUSTER={self.name}".encode()
        conf = f"SLURM_CONF={self.conf}".encode()
        mine = {os.getpid(), os.getppid()}
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in mine:
                continue
            try:  # a zombie's environ reads empty: it is not counted
                environ = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            job = conf in environ and any(e.startswith(b"SLURM_JOB_ID=") for e in environ)
            if daemon in environ or job:
                found.append(int(entry.name))
        return found

    def _kill_leftovers(self) -> None:
        """SIGKILL every process of this cluster still alive: slurmstepd and job tasks outlive
        slurmd."""
        for _ in range(5):
            found = self.processes()
            if not found:
                return
            for pid in found:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)

    # -- clients -------------------------------------------------------------------------------

    def run(
        self, *argv: str, timeout: float = 10, check: bool = True, cwd: Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client (`scontrol`, `sinfo`, `squeue`, `sbatch`, `srun`, `scancel`) on this
        cluster.

        Runs in `root/jobs` unless `cwd` is given, so a job's default `slurm-%j.out` lands there.
        Raises SlurmCommandError (with stderr) on a non-zero exit when `check`.
        """
        cmd = [which(argv[0]) or argv[0], *argv[1:]]
        done = subprocess.run(
            cmd,
            env=self.client_env(),
            cwd=cwd or self.root / "jobs",
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and done.returncode != 0:
            raise SlurmCommandError(done.returncode, list(argv), done.stdout, done.stderr)
        return done

    def drain(self, node: str, reason: str) -> None:
        self.run("scontrol", "update", f"nodename={node}", "state=drain", f"reason={reason}")

    def down(self, node: str, reason: str) -> None:
        self.run("scontrol", "update", f"nodename={node}", "state=down", f"reason={reason}")

    def resume(self, node: str) -> None:
        self.run("scontrol", "update", f"nodename={node}", "state=resume")

    def node_states(self) -> dict[str, NodeState]:
        """Every node's base state, flags and reason, from `sinfo --json` (22.05: `state` is a
        string)."""
        data = json.loads(self.run("sinfo", "--json").stdout)
        return {
            n["name"]: NodeState(
                str(n["state"]).upper(), tuple(n.get("state_flags") or ()), n.get("reason") or ""
            )
            for n in data["nodes"]
        }

    def log_tails(self, lines: int = 15) -> str:
        """The last lines of every daemon's stderr (which has all its log, and errors before it
        opened it)."""
        parts = []
        for log in sorted((self.root / "log").glob("*.out")):
            text = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {log.name}\n" + "\n".join(text))
        return "\n".join(parts)
