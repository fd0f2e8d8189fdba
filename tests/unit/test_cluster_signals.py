"""What a cluster detector tells a job of its nodes (`wire.NodeEvent`), over the real control
channel.

Each test runs the real `Coordinator` against in-process fake ranks speaking the real protocol
(`fake_ranks`), each on a node of its own; the detector's part is played by `request`, as
`workers.detectors.reports` sends it. The detectors themselves run against the real cluster clients
in `tests/integration`.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

from job_agent import wire
from job_agent.coordinator.jobs import request
from tests.unit.job_driver import Counts, Job, Migration, until
from torchpass.models import Disposition, EventSource, FailureKind
from workers.detectors.reports import Jobs, Seen

K = FailureKind


def _event(node: str, kind: FailureKind, key: str, reason: str = "") -> wire.NodeEvent:
    return wire.NodeEvent(
        node=node,
        kind=kind,
        source="kubernetes",
        reason=reason,
        key=key,
        observed_at=datetime.now(UTC),
    )


T = TypeVar("T")


async def in_thread(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in a thread of its own, joined before it returns: the loop's executor would keep
    a second thread of its own when two calls overlap, which the leak check counts against the
    job."""
    out: list[T] = []
    thread = threading.Thread(target=lambda: out.append(fn(*args)), name="test-detector")
    thread.start()
    while thread.is_alive():
        await asyncio.sleep(0.01)
    thread.join()
    return out[0]


async def _tell(job: Job, ev: wire.NodeEvent) -> dict[str, object]:
    reply = await in_thread(request, job.spec.state_dir, job.spec.job_id, ev)
    assert isinstance(reply, wire.Ok), reply
    return reply.detail


def _node(job: Job, slot: int) -> str:
    m = job.coordinator.roster.at(slot)
    assert m is not None
    return m.node


async def _training_past(job: Job, step: int) -> None:
    c = job.coordinator
    await until(
        lambda: min(m.step for m in c.roster.ranks()) >= step, f"every rank past step {step}"
    )


async def test_a_cordon_moves_the_nodes_rank_live_and_said_again_starts_nothing(
    tmp_path: Path, allowance: Counts
) -> None:
    """A cordon of rank 1's node is a planned move: the report carries the cluster's evidence, the
    rank is moved live to a spare (on another node), and the same cordon heard again (a restarted
    detector), or a new observation of that node once the rank has left, starts nothing."""
    job = Job(tmp_path, allowance, nproc=3, spares=1)
    job.launcher.step_seconds = 0.05
    async with job:
        await _training_past(job, 2)
        node = _node(job, 1)
        said = await _tell(job, _event(node, K.NODE_CORDON, "uid-1:cordon", "security patch"))
        assert said == {"acted": True, "slots": [1], "kind": "node_cordon", "ranks": "moving"}
        workflow_id, report = await job.report()
        ev = report.evidence
        assert (ev.kind, ev.source, ev.slots, ev.failure_domain) == (
            K.NODE_CORDON,
            EventSource.KUBERNETES,
            (1,),
            node,
        )
        assert "security patch" in ev.detail and ev.scheduler == "kubernetes"
        m = Migration(job, workflow_id, report)
        outcome = await m.run()
        assert (outcome.disposition, outcome.steps_recomputed) == (Disposition.MIGRATED, 0)
        assert _node(job, 1) != node
        again = await _tell(job, _event(node, K.NODE_CORDON, "uid-1:cordon"))
        assert again["acted"] is False and "already heard" in str(again["why"])
        later = await _tell(job, _event(node, K.NODE_DRAIN, "uid-1:drain"))
        assert later == {"acted": False, "why": f"no rank of job {job.spec.job_id} runs on {node}"}
        await job.finished()
    assert job.reports.empty() and job.result is not None and len(job.result.incidents) == 1


async def test_a_node_with_no_rank_of_the_job_starts_nothing_and_its_spare_is_not_used(
    tmp_path: Path, allowance: Counts
) -> None:
    """A cordon of a node that runs only a spare of the job starts nothing; that spare is never
    given a slot afterwards: rank 0's loss takes the other spare."""
    job = Job(tmp_path, allowance, nproc=3, spares=2)
    job.launcher.step_seconds = 0.05
    async with job:
        await _training_past(job, 1)
        c = job.coordinator
        spare = next(m for m in c.roster.members.values() if m.slot < 0 and m.alive)
        said = await _tell(job, _event(spare.node, K.NODE_CORDON, "uid-s:cordon"))
        assert said == {
            "acted": False,
            "why": f"no rank of job {job.spec.job_id} runs on {spare.node}",
        }
        assert job.reports.empty()
        job.launcher.fail_at(0, c.roster.at(0).step + 2)  # type: ignore[union-attr]
        m = Migration(job, *await job.report())
        assert (await m.run()).disposition is Disposition.MIGRATED
        assert m.reserved is not None and spare.agent_id not in m.reserved.spare_ids
        await job.finished()


async def test_not_ready_for_a_node_the_job_still_hears_is_a_planned_move(
    tmp_path: Path, allowance: Counts
) -> None:
    """The cluster says rank 2's node is NotReady while its rank still heart-beats to the
    coordinator: the job listens a moment (a power loss would show by then) and its view wins.
    Nothing is killed; the rank is moved off as a planned move, and the evidence says why."""
    job = Job(tmp_path, allowance, nproc=3, spares=1)
    job.launcher.step_seconds = 0.05
    async with job:
        await _training_past(job, 2)
        job.coordinator.cluster.quiet = 0.3  # it listens that long before it decides
        said = await _tell(job, _event(_node(job, 2), K.NODE_NOT_READY, "uid-2:ready:False"))
        assert said["acted"] is False and "checking" in str(said["why"])
        workflow_id, report = await job.report()
        assert (
            report.evidence.kind is K.NODE_DRAIN and "still hears from it" in report.evidence.detail
        )
        outcome = await Migration(job, workflow_id, report).run()
        assert (outcome.disposition, outcome.kind) == (Disposition.MIGRATED, K.NODE_DRAIN)
        await job.finished()


async def test_not_ready_for_a_node_gone_quiet_fences_its_rank_and_is_migrated_live(
    tmp_path: Path, allowance: Counts
) -> None:
    """Rank 1 stops (its node froze); before the job's own hang detection fires, the cluster says
    its node is NotReady. The job hears nothing from it either, so the claim stands: the rank is
    fenced and killed, the incident is a node failure of the cluster's kind, migrated live."""
    job = Job(tmp_path, allowance, nproc=3, spares=1, hang_timeout=8.0)
    job.launcher.step_seconds = 0.05
    async with job:
        c = job.coordinator
        c.cluster.quiet = 0.3
        job.launcher.hang_at(1, 4)
        victim = c.roster.at(1)
        assert victim is not None
        await until(
            lambda: time.monotonic() - victim.last_heartbeat > 0.5, "rank 1's node to go quiet"
        )
        said = await _tell(job, _event(victim.node, K.NODE_NOT_READY, "uid-1:ready:Unknown"))
        assert said == {"acted": True, "slots": [1], "kind": "node_not_ready", "ranks": "failed"}
        workflow_id, report = await job.report()
        assert report.evidence.kind is K.NODE_NOT_READY
        m = Migration(job, workflow_id, report)
        outcome = await m.run()
        assert (outcome.disposition, outcome.kind, outcome.steps_recomputed) == (
            Disposition.MIGRATED,
            K.NODE_NOT_READY,
            0,
        )
        assert victim.fenced and job.launcher.poll(victim.agent_id) is not None
        await job.finished()


async def test_not_ready_after_the_ranks_died_is_evidence_of_the_same_incident(
    tmp_path: Path, allowance: Counts
) -> None:
    """A power loss as the job sees it: rank 2 exits first (the incident starts), then the cluster
    says its node is NotReady. The second signal is one more piece of evidence of the same incident
    (same workflow id), whose kind becomes the most specific: the node's."""
    job = Job(tmp_path, allowance, nproc=3, spares=1)
    job.launcher.fail_at(2, 5)
    async with job:
        workflow_id, first = await job.report()
        node = first.evidence.failure_domain
        said = await _tell(
            job, _event(node, K.NODE_NOT_READY, "uid-2:ready:Unknown", "kubelet stopped")
        )
        assert said["acted"] is True and said["slots"] == [2]
        same, second = await job.report()
        assert same == workflow_id and second.evidence.kind is K.NODE_NOT_READY
        m = Migration(job, workflow_id, first)
        m.evidence.append(second.evidence)
        outcome = await m.run()
        assert (outcome.disposition, outcome.kind) == (Disposition.MIGRATED, K.NODE_NOT_READY)
        await job.finished()
    assert job.result is not None and len(job.result.incidents) == 1


async def test_not_ready_after_the_incident_was_recorded_goes_into_its_history_late(
    tmp_path: Path, allowance: Counts
) -> None:
    """Rank 2 exits and is migrated; only then does the cluster say its node is NotReady (a real
    kubelet's silence takes some 40 s). Still that incident's evidence: a late report to its run
    (open for the job's late window), nothing new started. Said again, already heard; past the
    window, nothing."""
    job = Job(tmp_path, allowance, nproc=3, spares=1)
    job.launcher.fail_at(2, 5)
    async with job:
        workflow_id, first = await job.report()
        node = first.evidence.failure_domain
        m = Migration(job, workflow_id, first)
        outcome = await m.run()
        assert (
            outcome.disposition is Disposition.MIGRATED
            and job.coordinator.incidents.current is None
        )
        said = await _tell(
            job, _event(node, K.NODE_NOT_READY, "uid-2:ready:Unknown", "kubelet stopped")
        )
        assert said["acted"] is True and said["late"] is True and said["incident"] == m.incident_id
        to, late = await job.report()
        assert to == m.incident_id and late.late and late.evidence.kind is K.NODE_NOT_READY
        assert late.evidence.slots == (2,) and late.linger_seconds == job.spec.late_window
        again = await _tell(job, _event(node, K.NODE_NOT_READY, "uid-2:ready:Unknown"))
        assert again["acted"] is False and "already heard" in str(again["why"])
        job.coordinator.incidents.late_window = timedelta(0)  # the run has closed by now
        gone = await _tell(job, _event(node, K.NODE_NOT_READY, "uid-2:ready:Unknown:later"))
        assert gone["acted"] is False and job.reports.empty()
        await job.finished()
    assert job.result is not None and len(job.result.incidents) == 1


async def test_a_detector_tells_every_registered_job_and_one_that_is_gone_is_an_answer_too(
    tmp_path: Path, allowance: Counts
) -> None:
    """`workers.detectors.reports.Jobs` over the real registry and control channel: the running job
    hears a cordon of its rank's node and acts; a job registered but gone (its coordinator's port
    closed) is answered as not reached, and the detector goes on; a pod's deletion is told only to
    the pod's job."""
    gone = tmp_path / "jobs" / "gone-job"
    gone.mkdir(parents=True)
    (gone / "secret").write_text("00" * 32)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    (gone / "job.json").write_text(
        json.dumps({"job_id": "gone-job", "coordinator": f"127.0.0.1:{closed}", "pid": 1})
    )
    job = Job(tmp_path, allowance, nproc=3, spares=1)
    job.launcher.step_seconds = 0.05
    async with job:
        await _training_past(job, 1)
        jobs, node = Jobs(tmp_path, "kubernetes"), _node(job, 0)
        pod = await in_thread(
            jobs.tell, Seen(node, K.POD_DELETED, "p:gone", "pod deleted", job="gone-job")
        )
        assert [(t.job_id, t.acted) for t in pod] == [("gone-job", False)] and "not reached" in pod[
            0
        ].detail
        told = {
            t.job_id: t for t in await in_thread(jobs.tell, Seen(node, K.NODE_CORDON, "u0:cordon"))
        }
        assert told[job.spec.job_id].acted and not told["gone-job"].acted
        m = Migration(job, *await job.report())
        assert (await m.run()).disposition is Disposition.MIGRATED
        await job.finished()
