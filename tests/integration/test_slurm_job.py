"""A torchpass job on a real Slurm cluster, launched with the deploy template, and the Slurm detector.

Everything is real: a private munged, slurmctld and one slurmd per node (`tests/slurm`, Debian's slurm-wlm
22.05; three node names on this one host), `sbatch deploy/slurm/torchpass.sbatch` starting the coordinator
and `srun`-ing one node agent per node (two training nodes and a spare node), torch.distributed ranks,
the incidents' MigrationWorkflows on the real dev server, and `workers.slurm.SlurmDetector` reading the
nodes with `sinfo` while an operator runs `scontrol update nodename=node2 state=drain reason=...`.

The drain moves both of node2's ranks to the spare node's warm spares while they still work (a planned
migration, the state taken at one step boundary), and the job ends bitwise equal to the same job on one
host never interrupted. A second detector started after the move, re-reading the same drained node while
the job still trains, starts nothing. Skipped only where Slurm cannot run at all (not root, or the
packages cannot be installed).
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from temporalio.client import Client

from job_agent import wire
from job_agent.jobs import request
from tests.integration.conftest import LONG_ARGS, ROOT, SCRIPT
from tests.slurm.cluster import SlurmCluster, available
from torchpass.job import JobResult
from torchpass.models import Category, Disposition, EventSource, FailureKind, FailureReport
from torchpass.steps import ConfirmResult
from workers.detect import Jobs
from workers.slurm import SlurmDetector, SlurmSettings, node_seen, read_nodes

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


async def test_a_drain_in_slurm_moves_every_rank_of_the_node_live_and_a_restarted_detector_starts_nothing(
    client: Client,
    tmp_path: Path,
    cluster: SlurmCluster,
    monkeypatch: pytest.MonkeyPatch,
    long_reference: JobResult,
) -> None:
    state, job_id = tmp_path / "state", "slurm-drain"
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
    }.items():
        monkeypatch.setenv(k, v)
    out = tmp_path / "job.out"
    cluster.run("sbatch", "--nodes=3", f"--output={out}", str(TEMPLATE), *ARGS)
    detector = SlurmDetector(Jobs(state, "slurm"), SlurmSettings(poll_seconds=0.3))
    watching = threading.Thread(target=detector.run, daemon=True)
    watching.start()
    try:
        before = await _training(state, job_id, out)
        assert {r.node for r in before.ranks} == {"node1", "node2"} and "node3" in before.nodes, before
        moved = sorted(r.slot for r in before.ranks if r.node == "node2")
        cluster.drain("node2", "security patch")
        after = await _training(state, job_id, out, incidents=1)
        assert all(r.node != "node2" for r in after.ranks), after
        # A detector started now re-reads the same drained node: the job has heard it and acts on nothing.
        again = [seen for n in read_nodes() if (seen := node_seen(n)) is not None]
        assert [s.node for s in again] == ["node2"]
        told = await asyncio.to_thread(Jobs(state, "slurm").tell, again[0])
        assert [(t.job_id, t.acted) for t in told] == [(job_id, False)] and "already heard" in told[0].detail
        result = await _result(state, job_id, out)
    finally:
        detector.close()
        watching.join(10)

    assert result.ok, (result.error, out.read_text(errors="replace")[-3000:])
    (planned,) = result.incidents
    assert planned.disposition is Disposition.MIGRATED and planned.success, planned
    assert planned.classification.category is Category.PLANNED and planned.kind is FailureKind.NODE_DRAIN
    assert planned.failure_domain == "node2" and list(planned.lost_slots) == moved, planned
    history = await client.get_workflow_handle(planned.incident_id.split("/")[0]).fetch_history()
    started = history.events[0].workflow_execution_started_event_attributes.input.payloads[0].data
    evidence = FailureReport.model_validate_json(started).evidence  # what the detector's word became
    assert (evidence.source, evidence.scheduler, evidence.slots) == (EventSource.SLURM, "slurm", tuple(moved))
    assert "security patch" in evidence.detail
    (confirm,) = [  # what the job measured: the template named the batch host, the drained ranks leave
        ConfirmResult.model_validate_json(p.data)
        for e in history.events
        if e.HasField("activity_task_completed_event_attributes")
        for p in e.activity_task_completed_event_attributes.result.payloads
        if b'"fenced_slots"' in p.data
    ]
    assert confirm.batch_host == "node1" and confirm.leaving_slots == tuple(moved), confirm
    assert planned.proof is not None and set(planned.proof.donor_of.values()) <= set(moved), planned.proof
    assert result.steps_recomputed == 0 and result.final_digest == long_reference.final_digest
    assert cluster.node_states()["node2"].drained  # left for the operator to resume


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
    path = state / "jobs" / job_id / "result.json"
    deadline = time.monotonic() + 180
    while not path.exists():
        assert time.monotonic() < deadline, f"the job never ended:\n{_tail(out)}"
        await asyncio.sleep(0.2)
    await asyncio.sleep(0.2)  # written whole before it is read (write_text, then nothing)
    return JobResult.model_validate(json.loads(path.read_text()))


def _tail(out: Path) -> str:
    return out.read_text(errors="replace")[-4000:] if out.exists() else "(no output yet)"
