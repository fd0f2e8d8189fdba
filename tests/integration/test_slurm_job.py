"""A torchpass job on a real Slurm cluster, launched with the deploy template, and the Slurm
detector.

Everything is real: a private munged, slurmctld and one slurmd per node (`tests/slurm`, Debian's
slurm-wlm 22.05; three node names on this one host), `sbatch deploy/slurm/torchpass.sbatch` starting
the coordinator and `srun`-ing one node agent per node (two training nodes and a spare node),
torch.distributed ranks, the incidents' MigrationWorkflows on the real dev server, and
`workers.detectors.slurm.SlurmDetector` reading the nodes with `sinfo` while an operator runs
`scontrol update nodename=node2 state=drain reason=...`.

The drain moves both of node2's ranks to the spare node's warm spares while they still work (a
planned migration, the state taken at one step boundary), and the job ends bitwise equal to the same
job on one host never interrupted. A second detector started after the move, re-reading the same
drained node while the job still trains, starts nothing. Skipped only where Slurm cannot run at all
(not root, or the packages cannot be installed).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError
from temporalio.client import Client

from job_agent import wire
from job_agent.coordinator.jobs import registered_pid, request
from tests.integration.conftest import LONG_ARGS, ROOT, SCRIPT
from tests.slurm.cluster import SlurmCluster, available
from tests.unit.job_driver import until
from torchpass.incident.steps import ConfirmResult
from torchpass.job import JobResult, JobState
from torchpass.models import Category, Disposition, EventSource, FailureKind, FailureReport
from workers.detectors.reports import Jobs
from workers.detectors.slurm import SlurmDetector, SlurmSettings, node_seen, read_nodes
from workers.detectors.slurm_spares import PREFIX, SlurmSpares, SpareNodeSettings, read_queue

pytestmark = pytest.mark.integration
ARGS = LONG_ARGS
TEMPLATE = ROOT / "deploy" / "slurm" / "torchpass.sbatch"


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[SlurmCluster]:
    reason = available()
    if reason:
        pytest.skip(reason)
    with SlurmCluster(tmp_path / "slurm", nodes=3, spare_partition=None, spare_nodes=0) as c:
        yield c


@pytest.fixture
def spare_cluster(tmp_path: Path) -> Iterator[SlurmCluster]:
    """Two training nodes, and a `spares` partition of one node (spare1)."""
    reason = available()
    if reason:
        pytest.skip(reason)
    with SlurmCluster(tmp_path / "slurm", nodes=2, spare_partition="spares", spare_nodes=1) as c:
        yield c


async def test_a_slurm_drain_moves_the_nodes_ranks_live_and_a_restarted_detector_starts_nothing(
    client: Client,
    tmp_path: Path,
    cluster: SlurmCluster,
    monkeypatch: pytest.MonkeyPatch,
    long_reference: JobResult,
) -> None:
    state, job_id = tmp_path / "state", "slurm-drain"
    _environment(monkeypatch, cluster, client, state, job_id)
    out = tmp_path / "job.out"
    cluster.run("sbatch", "--nodes=3", f"--output={out}", str(TEMPLATE), *ARGS)
    detector = SlurmDetector(Jobs(state, "slurm"), SlurmSettings(poll_seconds=0.3))
    watching = threading.Thread(target=detector.run, daemon=True)
    watching.start()
    try:
        before = await _training(state, job_id, out)
        assert {r.node for r in before.ranks} == {"node1", "node2"} and "node3" in before.nodes, (
            before
        )
        moved = sorted(r.slot for r in before.ranks if r.node == "node2")
        cluster.drain("node2", "security patch")
        after = await _training(state, job_id, out, incidents=1)
        assert all(r.node != "node2" for r in after.ranks), after
        # A detector started now re-reads the same drained node: the job has heard it and acts on
        # nothing.
        again = [seen for n in read_nodes() if (seen := node_seen(n)) is not None]
        assert [s.node for s in again] == ["node2"]
        told = await asyncio.to_thread(Jobs(state, "slurm").tell, again[0])
        assert [(t.job_id, t.acted) for t in told] == [(job_id, False)] and "already heard" in told[
            0
        ].detail
        result = await _result(state, job_id, out)
    finally:
        detector.close()
        watching.join(10)

    assert result.ok, (result.error, out.read_text(errors="replace")[-3000:])
    (planned,) = result.incidents
    assert planned.disposition is Disposition.MIGRATED and planned.success, planned
    assert (
        planned.classification.category is Category.PLANNED
        and planned.kind is FailureKind.NODE_DRAIN
    )
    assert planned.failure_domain == "node2" and list(planned.lost_slots) == moved, planned
    history = await client.get_workflow_handle(planned.incident_id.split("/")[0]).fetch_history()
    started = history.events[0].workflow_execution_started_event_attributes.input.payloads[0].data
    # what the detector's word became
    evidence = FailureReport.model_validate_json(started).evidence
    assert (evidence.source, evidence.scheduler, evidence.slots) == (
        EventSource.SLURM,
        "slurm",
        tuple(moved),
    )
    assert "security patch" in evidence.detail
    # what the job measured: the template named the batch host, the drained ranks leave
    (confirm,) = [
        ConfirmResult.model_validate_json(p.data)
        for e in history.events
        if e.HasField("activity_task_completed_event_attributes")
        for p in e.activity_task_completed_event_attributes.result.payloads
        if b'"fenced_slots"' in p.data
    ]
    assert confirm.batch_host == "node1" and confirm.leaving_slots == tuple(moved), confirm
    assert planned.proof is not None and set(planned.proof.donor_of.values()) <= set(moved), (
        planned.proof
    )
    assert result.steps_recomputed == 0 and result.final_digest == long_reference.final_digest
    assert cluster.node_states()["node2"].drained  # left for the operator to resume


async def test_spare_nodes_come_from_the_spare_partition_and_one_that_took_ranks_is_replaced(
    client: Client, tmp_path: Path, spare_cluster: SlurmCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The allocation has no spare node; the job asks for one (`KEEP_SPARE_NODES=1`). The detector's
    keeper submits a one-node job to the `spares` partition running the job's node agent, which
    joins as a spare node. node2 is drained: its ranks move to warm spares. Once the spare node runs
    ranks, the keeper asks Slurm for another, which waits in the queue (the partition has no other
    node), and it asks only once over later polls. The job is then stopped (SIGTERM to its
    coordinator, as `scancel` would send): the waiting spare-node job is cancelled, the joined one
    ends with the job."""
    state, job_id = tmp_path / "state", "slurm-spares"
    _environment(
        monkeypatch, spare_cluster, client, state, job_id, SPARE_NODES="0", KEEP_SPARE_NODES="1"
    )
    out = tmp_path / "job.out"
    args = ("--steps", "100000", "--width", "128", "--depth", "2")  # it trains until stopped
    spare_cluster.run("sbatch", "--nodes=2", f"--output={out}", str(TEMPLATE), *args)
    settings = SpareNodeSettings(
        partition="spares",
        node_command=f"{sys.executable} -m torchpass.cli",
        host_command="echo 127.0.0.1",
    )
    keeper = SlurmSpares(state, settings)
    passes: list[list[str]] = []  # what each pass of the keeper submitted

    def keep() -> list[str]:
        submitted = keeper.keep()
        passes.append(submitted)
        return submitted

    detector = SlurmDetector(Jobs(state, "slurm"), SlurmSettings(poll_seconds=0.3), keep)
    watching = threading.Thread(target=detector.run, daemon=True)
    watching.start()
    name = f"{PREFIX}{job_id}"
    try:
        joined = await _status(state, job_id, out, lambda s: "spare1" in s.nodes and s.spares >= 4)
        assert {r.node for r in joined.ranks} == {"node1", "node2"}, joined
        assert [q.state for q in read_queue() if q.name == name] == ["RUNNING"]
        spare_cluster.drain("node2", "security patch")
        await _status(state, job_id, out, lambda s: s.incidents == 1 and s.incident is None)
        moved = await _status(state, job_id, out, lambda s: all(r.node != "node2" for r in s.ranks))
        # the spare node took a rank: another is asked for
        if "spare1" in {r.node for r in moved.ranks}:
            deadline = time.monotonic() + 30
            while sorted(q.state for q in read_queue() if q.name == name) != ["PENDING", "RUNNING"]:
                assert time.monotonic() < deadline, read_queue()
                await asyncio.sleep(0.3)
        seen = len(passes) + 1  # from the pass after the one that may be under way
        await until(
            lambda: len(passes) >= seen + 5, "five more passes of the spare keeper", timeout=30
        )
        assert not any(passes[seen:]), passes  # nothing more is asked for
        assert len([q for q in read_queue() if q.name == name]) <= 2, read_queue()
        pid = registered_pid(state / "jobs" / job_id)
        assert pid is not None
        os.kill(pid, signal.SIGTERM)
        result = await _result(state, job_id, out)
        deadline = time.monotonic() + 30
        # the waiting one cancelled, the joined one done
        while [q for q in read_queue() if q.name == name]:
            assert time.monotonic() < deadline, read_queue()
            await asyncio.sleep(0.3)
    finally:
        detector.close()
        watching.join(10)
    # stopped in order across its nodes: every rank at one step boundary, its state's digest said
    assert result.status is JobState.STOPPED and "stopped by SIGTERM" in (result.error or ""), (
        _tail(out)
    )
    assert result.final_digest is not None and result.steps_completed > 0, result
    (o,) = result.incidents
    assert (
        o.disposition is Disposition.MIGRATED and o.success and o.kind is FailureKind.NODE_DRAIN
    ), o


def _environment(
    mp: pytest.MonkeyPatch,
    cluster: SlurmCluster,
    client: Client,
    state: Path,
    job_id: str,
    **extra: str,
) -> None:
    """What the template and the Slurm clients read: the test cluster, the job, two ranks a node."""
    for k, v in {
        **cluster.env,
        "TORCHPASS_STATE_DIR": str(state),
        "TORCHPASS_TEMPORAL_ADDRESS": client.service_client.config.target_host,
        "TORCHPASS": f"{sys.executable} -m torchpass.cli",
        "TORCHPASS_JOB": job_id,
        "TORCHPASS_NODE_HOST_CMD": "echo 127.0.0.1",
        "SCRIPT": str(SCRIPT),
        "PER_NODE": "2",
        "SPARES_PER_NODE": "1",
        **extra,
    }.items():
        mp.setenv(k, v)


async def _status(
    state: Path, job_id: str, out: Path, ok: Callable[[wire.Status], bool]
) -> wire.Status:
    """The job's status once it trains with its four ranks and `ok` holds."""
    deadline = time.monotonic() + 120
    last = None
    while time.monotonic() < deadline:
        try:
            last = await asyncio.to_thread(request, state, job_id, wire.StatusRequest())
        except Exception:  # not registered yet
            await asyncio.sleep(0.2)
            continue
        if (
            isinstance(last, wire.Status)
            and last.state is JobState.TRAINING
            and len(last.ranks) == 4
            and ok(last)
        ):
            return last
        await asyncio.sleep(0.1)
    raise AssertionError(f"the job never got there: {last}\n{_tail(out)}")


async def _training(state: Path, job_id: str, out: Path, incidents: int = 0) -> wire.Status:
    """The job's status once its four ranks train, every node's spares are warm and `incidents` were
    recorded."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            s = await asyncio.to_thread(request, state, job_id, wire.StatusRequest())
        except Exception:  # not registered yet
            await asyncio.sleep(0.2)
            continue
        if (
            isinstance(s, wire.Status)
            and (s.state, len(s.ranks), s.incidents, s.incident) == ("training", 4, incidents, None)
            and s.spares >= 4 - 2 * incidents  # the spare node's two spares took node2's slots
        ):
            return s
        await asyncio.sleep(0.1)
    raise AssertionError(f"the job never trained:\n{_tail(out)}")


async def _result(state: Path, job_id: str, out: Path) -> JobResult:
    """The job's result once its `result.json` is there and whole (written with write_text: it may
    be read half-written)."""
    path = state / "jobs" / job_id / "result.json"
    deadline = time.monotonic() + 180
    while True:
        try:
            return JobResult.model_validate_json(path.read_text())
        except (OSError, ValidationError):
            assert time.monotonic() < deadline, f"the job never ended:\n{_tail(out)}"
            await asyncio.sleep(0.2)


def _tail(out: Path) -> str:
    return out.read_text(errors="replace")[-4000:] if out.exists() else "(no output yet)"
