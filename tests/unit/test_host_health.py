"""The node agent's reading of its own host (`job_agent.node.host_health`).

Filesystems are real: a tmpfs of 1 MiB mounted for the test (this needs root and CAP_SYS_ADMIN,
which the project's CI machine has; elsewhere that one test is skipped with the reason), filled and
unmounted for real, and plain directories checked with the real `statvfs`. The kernel's memory
counters are files in the format of /proc/meminfo, /proc/vmstat and cgroup v2's memory.events, under
a directory the test writes: an OOM kill cannot be caused safely on a shared machine, and the agent
reads these files and nothing else.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from job_agent.node.host_health import HostCondition, HostHealth, memory_cgroup
from torchpass.models import FailureKind

K = FailureKind


def fake_proc(
    root: Path, total_kb: int = 16 << 20, available_kb: int = 8 << 20, oom_kills: int = 0
) -> Path:
    proc = root / "proc"
    proc.mkdir(exist_ok=True)
    (proc / "meminfo").write_text(
        f"MemTotal:       {total_kb} kB\nMemFree:         1000 kB\nMemAvailable:   {available_kb} "
        "kB\n"
    )
    (proc / "vmstat").write_text(f"nr_free_pages 1000\npgfault 12345\noom_kill {oom_kills}\n")
    return proc


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    where = tmp_path / "mnt"
    where.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)],
        check=False,
        capture_output=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=False, capture_output=True)


def test_a_real_filesystem_filling_up_then_unmounted(tmpfs: Path, tmp_path: Path) -> None:
    health = HostHealth([tmpfs], min_free_disk=256 << 10, proc=fake_proc(tmp_path))
    assert health.poll() == []
    filler = tmpfs / "checkpoint.pt"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    with pytest.raises(OSError, match="No space left"):
        for _ in range(2048):
            os.write(fd, b"\0" * 4096)
    os.close(fd)
    (full,) = health.poll()
    assert full.kind is K.FILESYSTEM_FULL and full.active and full.path == str(tmpfs), full
    assert "bytes free" in full.detail
    assert health.poll() == []  # reported once while it lasts
    filler.unlink()
    (ended,) = health.poll()
    assert ended.kind is K.FILESYSTEM_FULL and not ended.active
    subprocess.run(["umount", str(tmpfs)], check=True)
    (gone,) = health.poll()
    assert (
        gone.kind is K.FILESYSTEM_UNMOUNTED and gone.active and "no longer mounted" in gone.detail
    ), gone
    assert health.poll() == []


def test_a_watched_directory_removed_is_unmounted_and_a_minimum_above_what_is_free_is_full(
    tmp_path: Path,
) -> None:
    kept, removed = tmp_path / "ckpt", tmp_path / "nfs"
    kept.mkdir()
    removed.mkdir()
    free = os.statvfs(kept).f_bavail * os.statvfs(kept).f_frsize
    health = HostHealth([kept, removed], min_free_disk=free + (1 << 40), proc=fake_proc(tmp_path))
    assert {(c.kind, c.path, c.active) for c in health.poll()} == {
        (K.FILESYSTEM_FULL, str(kept), True),
        (K.FILESYSTEM_FULL, str(removed), True),
    }
    removed.rmdir()
    changes = {(c.kind, c.path, c.active): c.detail for c in health.poll()}
    assert set(changes) == {
        (K.FILESYSTEM_UNMOUNTED, str(removed), True),
        (K.FILESYSTEM_FULL, str(removed), False),  # what it says of the path now is that it is gone
    }
    assert "errno 2" in changes[(K.FILESYSTEM_UNMOUNTED, str(removed), True)]
    healthy = HostHealth([kept], min_free_disk=0, proc=fake_proc(tmp_path))
    assert healthy.poll() == []


def test_memory_under_the_minimum_is_the_host_out_of_memory_until_it_recovers(
    tmp_path: Path,
) -> None:
    proc = fake_proc(tmp_path, available_kb=8 << 20)
    health = HostHealth(min_free_memory=0.02, proc=proc)
    assert health.poll() == []
    fake_proc(tmp_path, available_kb=100 << 10)  # 100 MiB of 16 GiB
    (low,) = health.poll()
    assert (
        low.kind is K.HOST_MEMORY_EXHAUSTED and low.active and "100 MiB available" in low.detail
    ), low
    assert health.poll() == []
    fake_proc(tmp_path, available_kb=4 << 20)
    (back,) = health.poll()
    assert back.kind is K.HOST_MEMORY_EXHAUSTED and not back.active


def test_a_sigkill_is_an_oom_kill_only_when_the_kernel_counted_one(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, oom_kills=3)
    health = HostHealth(proc=proc)
    assert health.oom_killed("process r-1") is None  # killed by someone else: not the OOM killer
    fake_proc(tmp_path, oom_kills=4)
    oom = health.oom_killed("process r-2")
    assert oom == HostCondition(
        K.HOST_MEMORY_EXHAUSTED,
        "process r-2 was OOM-killed: the host ran out of memory (not enough memory)",
    )
    assert health.oom_killed("process r-3") is None  # that kill was counted already


def test_an_oom_kill_at_the_cgroups_own_limit_is_the_containers_not_the_hosts(
    tmp_path: Path,
) -> None:
    proc = fake_proc(tmp_path, oom_kills=0)
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    (cgroup / "memory.events").write_text("low 0\nhigh 0\nmax 7\noom 0\noom_kill 0\n")
    health = HostHealth(proc=proc, cgroup=cgroup)
    fake_proc(tmp_path, oom_kills=1)
    (cgroup / "memory.events").write_text("low 0\nhigh 0\nmax 9\noom 1\noom_kill 1\n")
    oom = health.oom_killed("process r-1")
    assert oom is not None and oom.kind is K.OOM_KILL and "cgroup's limit" in oom.detail
    # The host's OOM killer taking a process of this cgroup counts in its oom_kill, not its oom.
    fake_proc(tmp_path, oom_kills=2)
    (cgroup / "memory.events").write_text("low 0\nhigh 0\nmax 9\noom 1\noom_kill 2\n")
    host = health.oom_killed("process r-2")
    assert host is not None and host.kind is K.HOST_MEMORY_EXHAUSTED


def test_no_proc_no_cgroup_no_conditions_and_nothing_raises(tmp_path: Path) -> None:
    health = HostHealth(proc=tmp_path / "absent")
    assert health.poll() == [] and health.oom_killed("process r-1") is None


def test_the_memory_cgroup_of_v1_and_v2(tmp_path: Path) -> None:
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (root / "memory" / "job" / "a").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text("5:devices:/\n4:memory:/job/a\n0::/\n")
    assert memory_cgroup(proc, root) == root / "memory" / "job" / "a"
    (root / "pod" / "c").mkdir(parents=True)
    (root / "pod" / "c" / "memory.events").write_text("oom 0\n")
    (proc / "self" / "cgroup").write_text("0::/pod/c\n")
    assert memory_cgroup(proc, root) == root / "pod" / "c"
    (proc / "self" / "cgroup").write_text("garbage\n")
    assert memory_cgroup(proc, root) is None
