"""GPU health through the real `nvidia-ml-py` bindings against a fake `libnvidia-ml.so.1`.

No GPU (and so no NVIDIA driver) exists on the machines that run these tests. The fake library
(`tests/nvml/fake_nvml.c`, built here with gcc) stands for the driver's NVML: the same entry points,
signatures and return codes the bindings call, its facts (devices, temperatures, ECC counts, row
remapping, lost GPUs, XID events) read from a state file each test writes. What is tested is our use
of the real bindings: which NVML facts become which signal, once.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from job_agent.node.gpu_health import CRITICAL_XIDS, GpuHealth
from tests import nvml
from torchpass.models import FailureKind as K

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def fake_nvml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return nvml.build(tmp_path_factory.mktemp("nvml"))


class Node:
    """The state file the fake library reads: what the node's GPUs report now."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seq = 0

    def set(self, *facts: str) -> None:
        with self.path.open("a") as f:
            f.writelines(fact + "\n" for fact in facts)

    def xid(self, gpu: int, xid: int) -> None:
        self.seq += 1
        self.set(f"xid {self.seq} {gpu} {xid}")


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Node:
    state = tmp_path / "nvml-state"
    monkeypatch.setenv("FAKE_NVML_STATE", str(state))
    n = Node(state)
    n.set("gpus 4", *(f"temp {i} 60" for i in range(4)), *(f"ecc {i} 0" for i in range(4)))
    return n


@pytest.fixture
def health(fake_nvml: Path, node: Node) -> Iterator[GpuHealth]:
    h = GpuHealth(max_temperature=85, library=str(fake_nvml))
    yield h
    h.close()


def test_the_gpus_are_found_and_a_healthy_node_reports_nothing(health: GpuHealth) -> None:
    assert health.gpus == [0, 1, 2, 3] and not health.reason
    assert health.poll() == [] == health.poll(wait_ms=50)


@pytest.mark.parametrize("xid", sorted(CRITICAL_XIDS))
def test_each_critical_xid_is_a_failure_of_its_gpu_reported_once(
    health: GpuHealth, node: Node, xid: int
) -> None:
    node.xid(2, xid)
    [signal] = health.poll(wait_ms=500)
    assert (signal.gpu, signal.kind, signal.planned, signal.xid) == (
        2,
        CRITICAL_XIDS[xid][0],
        False,
        xid,
    )
    assert f"XID {xid}" in signal.detail
    assert health.poll(wait_ms=50) == []  # the same event is not read twice


def test_the_kinds_follow_the_xid_catalogue() -> None:
    assert CRITICAL_XIDS[79][0] is K.GPU_FELL_OFF_BUS and CRITICAL_XIDS[74][0] is K.NVLINK_ERROR
    assert {CRITICAL_XIDS[x][0] for x in (48, 94, 95, 63, 64)} == {K.GPU_ECC_UNCORRECTABLE}


def test_a_non_critical_xid_is_not_a_failure(health: GpuHealth, node: Node) -> None:
    node.xid(0, 13)  # a graphics engine exception: the application's error, not the GPU's
    assert health.poll(wait_ms=100) == []


def test_a_temperature_ramp_warns_once_at_the_threshold_and_again_after_it_cooled(
    health: GpuHealth, node: Node
) -> None:
    seen = []
    for celsius in (70, 80, 84, 85, 88, 90, 80, 86):
        node.set(f"temp 1 {celsius}")
        seen.append([(s.gpu, s.kind, s.planned) for s in health.poll()])
    warning = [(1, K.GPU_TEMPERATURE, True)]
    assert seen == [[], [], [], warning, [], [], [], warning]


def test_rising_uncorrectable_ecc_and_pending_remaps_are_warnings(
    health: GpuHealth, node: Node
) -> None:
    health.poll()  # the counts as the detector starts: its baseline
    node.set("ecc 3 2")
    [rose] = health.poll()
    assert (rose.gpu, rose.kind, rose.planned) == (
        3,
        K.GPU_ECC_UNCORRECTABLE,
        True,
    ) and "0 -> 2" in rose.detail
    assert health.poll() == []  # the same count: nothing new
    node.set("remap 0 0 0 1 0")
    [pending] = health.poll()
    assert (pending.gpu, pending.planned) == (0, True) and "remapped" in pending.detail
    assert health.poll() == []


def test_a_lost_gpu_is_a_failure_reported_once(health: GpuHealth, node: Node) -> None:
    node.set("lost 1")
    [lost] = health.poll()
    assert (lost.gpu, lost.kind, lost.planned) == (1, K.GPU_LOST, False)
    assert health.poll() == []


def test_a_restarted_reader_does_not_report_the_past_events_again(
    fake_nvml: Path, node: Node
) -> None:
    first = GpuHealth(library=str(fake_nvml))
    node.xid(0, 79)
    assert [s.xid for s in first.poll(wait_ms=500)] == [79]
    first.close()
    again = GpuHealth(library=str(fake_nvml))
    try:
        assert again.poll(wait_ms=100) == []
    finally:
        again.close()


def test_no_driver_means_no_gpus_and_no_error(fake_nvml: Path, node: Node) -> None:
    node.set("no_driver")
    h = GpuHealth(library=str(fake_nvml))
    assert h.gpus == [] and "no GPUs" in h.reason and h.poll() == []


def test_no_nvml_library_means_no_gpus_and_no_error() -> None:
    """The bindings failing to load the library (a host without the driver) as they do here; loading
    it is made to fail, so that a host with a real driver tests the same."""
    code = (
        "import pynvml\n"
        "def missing(*a, **k): raise OSError('libnvidia-ml.so.1: cannot open shared object file')\n"
        "pynvml.CDLL = missing\n"
        "from job_agent.node.gpu_health import GpuHealth; h = GpuHealth(); print(h.gpus, h.reason)"
    )
    cmd = [sys.executable, "-c", code]
    out = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("[] no GPUs"), out.stdout


def test_a_reading_a_gpu_does_not_offer_leaves_the_others_read(
    health: GpuHealth, node: Node
) -> None:
    """No ECC on the board, no row remapper before Ampere: NVML says NOT_SUPPORTED for those, and
    the temperature is still watched."""
    node.set("unsupported 2 ecc", "unsupported 2 remap")
    assert health.poll() == []
    node.set("temp 2 91")
    [hot] = health.poll()
    assert (hot.gpu, hot.kind) == (2, K.GPU_TEMPERATURE)


def test_the_same_xid_again_later_is_a_new_failure(health: GpuHealth, node: Node) -> None:
    node.xid(1, 94)
    assert [s.xid for s in health.poll(wait_ms=500)] == [94]
    node.xid(1, 94)
    assert [s.xid for s in health.poll(wait_ms=500)] == [94]


def test_other_xids_never_hold_up_the_state_reads(health: GpuHealth, node: Node) -> None:
    """NVML's critical-XID events carry every XID; a stream of those that are not failures (43: a
    process killed) is read and let go, and the temperature is read within the poll's wait."""
    for _ in range(30):
        node.xid(0, 43)
    node.set("temp 3 95")
    [hot] = health.poll(wait_ms=200)
    assert (hot.gpu, hot.kind) == (3, K.GPU_TEMPERATURE)


def test_a_report_of_a_kind_that_is_not_a_gpus_is_refused() -> None:
    """A node speaks for its GPUs only: it cannot start an incident of another kind through them."""
    from pydantic import ValidationError

    from job_agent import wire

    fields = {"gpu": 0, "agent_ids": ("rank0-1", "rank0-1"), "detail": "", "planned": False}
    assert wire.GpuReport(kind=K.GPU_FELL_OFF_BUS, **fields).agent_ids == ("rank0-1",)
    for kind, planned in (
        (K.FABRIC_OUTAGE, False),
        (K.SILENT_DATA_CORRUPTION, False),
        (K.GPU_LOST, True),
    ):
        with pytest.raises(ValidationError, match="a GPU"):
            wire.GpuReport(kind=kind, **{**fields, "planned": planned})


@pytest.mark.parametrize(
    ("local_rank", "visible", "index"),
    [(1, None, 1), (9, None, 1), (1, "4,5,6,7", 5), (5, "4,5,6,7", 5), (0, "GPU-8e1f", None)],
)
def test_a_processs_gpu_is_the_one_its_local_rank_names(
    local_rank: int, visible: str | None, index: int | None
) -> None:
    from job_agent.node.gpu_health import nvml_index

    environ = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert nvml_index(local_rank, 8, environ) == index
