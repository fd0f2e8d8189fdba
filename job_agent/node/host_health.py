"""What a node agent sees of its own host: the filesystems the job writes to, and its memory.

The brief's shared-infrastructure row ("filesystem unmount; filesystem full; not enough memory") is
decided from these readings, never guessed from a rank's exit code:

- a **watched path** (`--watch-path`, e.g. the checkpoint directory) is *unmounted* when it was a
  mount point and no longer is (or its device changed), or when it cannot be read at all (ENOENT,
  ESTALE, EIO, ENOTCONN); it is *full* when fewer than `min_free_disk` bytes, or no inodes, are left
  to its user;
- the host is *out of memory* when its available memory (`MemAvailable` in /proc/meminfo) is under
  `min_free_memory` of the total;
- a process that died of SIGKILL that nobody here sent was **OOM-killed** when the kernel's OOM kill
  count (/proc/vmstat `oom_kill`) rose since the last reading. Which OOM: the agent's memory cgroup
  reaching its own limit (cgroup v2 `memory.events` `oom`, v1 `memory.failcnt`) is the job's
  container at its limit, an interruption the brief counts (`oom_kill`); otherwise the whole host
  ran out (`host_memory_exhausted`).

Conditions are reported when they begin and when they end, each once: re-reading the same state
reports nothing. A reading that cannot be had (no /proc on this system, a cgroup file absent) is
left out; nothing raises.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from torchpass.models import FailureKind

K = FailureKind
# A path that raises one of these is gone from under the job: the filesystem was unmounted or its
# server lost (ENOENT: the mount point's directory itself is gone).
_UNMOUNTED = {errno.ENOENT, errno.ESTALE, errno.EIO, errno.ENOTCONN, errno.ENODEV, errno.EHOSTDOWN}


@dataclass(frozen=True)
class HostCondition:
    kind: FailureKind
    detail: str
    active: bool = True  # False: the condition of that kind (and path) has ended
    path: str = ""


class HostHealth:
    """The readings of one host; `poll` returns the conditions that began or ended since the last
    call."""

    def __init__(
        self,
        paths: Sequence[Path] = (),
        min_free_disk: int = 64 << 20,
        min_free_memory: float = 0.02,
        proc: Path = Path("/proc"),
        cgroup: Path | None = None,
    ) -> None:
        self.paths = tuple(paths)
        self.min_free_disk = min_free_disk
        self.min_free_memory = min_free_memory
        self._proc = proc
        self._cgroup = cgroup if cgroup is not None else memory_cgroup(proc)
        # Each path as first seen: a mount point (its device), or a plain directory (None).
        self._mounts = {p: _device(p) if os.path.ismount(p) else None for p in self.paths}
        self._on: dict[tuple[FailureKind, str], str] = {}  # conditions now holding -> their detail
        self._oom_kills = self._count(proc / "vmstat", "oom_kill")
        self._limit_hits = self._cgroup_limit_hits()

    def poll(self) -> list[HostCondition]:
        now: dict[tuple[FailureKind, str], str] = {}
        for p in self.paths:
            kind_detail = self._path(p)
            if kind_detail is not None:
                now[(kind_detail[0], str(p))] = kind_detail[1]
        memory = self._memory()
        if memory is not None:
            now[(K.HOST_MEMORY_EXHAUSTED, "")] = memory
        changes = [
            HostCondition(k, d, True, p) for (k, p), d in now.items() if (k, p) not in self._on
        ]
        changes += [
            HostCondition(k, f"ended: {d}", False, p)
            for (k, p), d in self._on.items()
            if (k, p) not in now
        ]
        self._on = now
        return changes

    def _path(self, p: Path) -> tuple[FailureKind, str] | None:
        mounted_on = self._mounts[p]
        try:
            st = os.statvfs(p)
            device = _device(p)
        except OSError as e:
            if e.errno in _UNMOUNTED:
                return K.FILESYSTEM_UNMOUNTED, f"{p} cannot be read: {e.strerror} (errno {e.errno})"
            return None  # EACCES and the like: not the filesystem's failure
        if mounted_on is not None and (device != mounted_on or not os.path.ismount(p)):
            return K.FILESYSTEM_UNMOUNTED, f"{p} is no longer mounted (it was a mount point)"
        free = st.f_bavail * st.f_frsize
        if free < self.min_free_disk:
            return K.FILESYSTEM_FULL, (
                f"{p}: {free} bytes free of {st.f_blocks * st.f_frsize} (under "
                f"{self.min_free_disk})"
            )
        if st.f_files and not st.f_favail:
            return K.FILESYSTEM_FULL, f"{p}: no inodes left ({st.f_files} in all)"
        return None

    def _memory(self) -> str | None:
        info = _fields(self._proc / "meminfo")
        total, available = info.get("MemTotal"), info.get("MemAvailable")
        if not total or available is None or available >= self.min_free_memory * total:
            return None
        return (
            f"host memory: {available // 1024} MiB available of {total // 1024} MiB"
            f" (under {self.min_free_memory:.0%})"
        )

    def oom_killed(self, what: str) -> HostCondition | None:
        """`what` died of a SIGKILL nobody here sent: the OOM killer's doing if the kernel's count
        of OOM kills rose since the last reading; the container's limit or the whole host, as the
        cgroup says."""
        kills, hits = self._count(self._proc / "vmstat", "oom_kill"), self._cgroup_limit_hits()
        rose = kills is not None and self._oom_kills is not None and kills > self._oom_kills
        at_limit = hits is not None and self._limit_hits is not None and hits > self._limit_hits
        self._oom_kills, self._limit_hits = kills, hits
        if not rose:
            return None
        if at_limit:
            return HostCondition(K.OOM_KILL, f"{what} was OOM-killed at its memory cgroup's limit")
        return HostCondition(
            K.HOST_MEMORY_EXHAUSTED,
            f"{what} was OOM-killed: the host ran out of memory (not enough memory)",
        )

    def _cgroup_limit_hits(self) -> int | None:
        if self._cgroup is None:
            return None
        v2 = self._count(self._cgroup / "memory.events", "oom")
        return v2 if v2 is not None else _number(self._cgroup / "memory.failcnt")

    @staticmethod
    def _count(path: Path, name: str) -> int | None:
        return _fields(path).get(name)


def memory_cgroup(proc: Path = Path("/proc"), root: Path = Path("/sys/fs/cgroup")) -> Path | None:
    """This process's memory cgroup directory (v2 unified, or v1's memory controller), if
    readable."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2) if line.count(":") >= 2 else ("", "", "")
        if controllers == "memory" and (root / "memory" / path.lstrip("/")).is_dir():
            return root / "memory" / path.lstrip("/")
        if controllers == "" and path and (root / path.lstrip("/") / "memory.events").exists():
            return root / path.lstrip("/")
    return None


def _device(p: Path) -> int:
    return os.stat(p).st_dev


def _fields(path: Path) -> dict[str, int]:
    """`name value [unit]` lines (/proc/meminfo, /proc/vmstat, memory.events): name -> value; {}
    unread."""
    try:
        text = path.read_text()
    except OSError:
        return {}
    out: dict[str, int] = {}
    for line in text.splitlines()[:4096]:
        parts = line.replace(":", " ").split()
        if len(parts) >= 2 and parts[1].isdigit():
            out[parts[0]] = int(parts[1])
    return out


def _number(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
