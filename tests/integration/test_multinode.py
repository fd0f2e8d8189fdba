"""Multi-node jobs: the coordinator on one host, a node agent (`torchpass node`) on each other host
running its ranks and warm spares, every listener on its host's own address.

Hosts are network namespaces on a bridge, each with its own address, made and removed by
`tests/integration/hosts.py` (or, where namespaces cannot be made, one loopback address each; the
test prints which). Everything else is real: the node agents are `torchpass node` processes, the
ranks real torch.distributed processes (gloo over the hosts' addresses), the kills real SIGKILLs,
the incidents MigrationWorkflows on the real dev server. A migrated run must end bitwise equal to
the same job never failed, with no completed step recomputed.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client

from job_agent import wire
from job_agent.coordinator.jobs import request
from job_agent.node.agent import EXIT_REFUSED
from job_agent.wire.protocol import EXIT_COORDINATOR_LOST
from tests.integration.conftest import SCRIPT, run_with, spec, start_job
from torchpass.dev.hosts import Fabric, Host, fabric
from torchpass.job import JobResult, JobSpec
from torchpass.models import Category, Disposition, FailureKind

STEPS = 150
ARGS = ("--steps", str(STEPS), "--width", "128", "--depth", "2")


@pytest.fixture
def hosts() -> Iterator[Fabric]:
    with fabric(2) as f:
        print(f"multi-node test hosts: {f.mode} ({', '.join(h.address for h in f.hosts)})")
        yield f


@pytest.fixture(scope="module")
async def long_reference(client: Client, tmp_path_factory: pytest.TempPathFactory) -> JobResult:
    """The job on one host, never failed: the state a multi-node run must match bit for bit."""
    job = spec(tmp_path_factory.mktemp("ref"), "mn-reference", spares=0, args=ARGS)
    result = await run_with(client, job)
    assert result.ok and result.final_digest
    return result


def node_argv(
    job: JobSpec, coordinator: str, host: Host, slots: int, spares: int, **kw: Any
) -> list[str]:
    argv = [sys.executable, "-m", "torchpass.cli", "node", "--job", kw.get("job_id", job.job_id)]
    argv += [
        "--coordinator",
        coordinator,
        "--secret-file",
        kw.get("secret", str(job.job_dir / "secret")),
    ]
    argv += ["--host", host.address, "--name", kw.get("name", host.name)]
    argv += ["--coordinator-wait", kw.get("wait", "120")]
    return [
        *argv,
        "--slots",
        str(slots),
        "--spares",
        str(spares),
        str(SCRIPT),
        *kw.get("args", ARGS),
    ]


async def coordinator_of(job: JobSpec) -> str:
    """The address the job's coordinator registered (the one it printed for its nodes)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return str(json.loads((job.job_dir / "job.json").read_text())["coordinator"])
        except (OSError, ValueError, KeyError):
            assert time.monotonic() < deadline, "the coordinator never registered"
            await asyncio.sleep(0.05)


async def status(job: JobSpec) -> wire.Status:
    reply = await asyncio.to_thread(request, job.state_dir, job.job_id, wire.StatusRequest())
    assert isinstance(reply, wire.Status), reply
    return reply


def log_of(tmp_path: Path, name: str) -> str:
    return (tmp_path / f"{name}.log").read_text(errors="replace")


async def test_a_rank_killed_on_a_node_is_replaced_by_the_spare_on_its_own_node(
    client: Client, tmp_path: Path, hosts: Fabric, long_reference: JobResult
) -> None:
    job = spec(tmp_path, "mn-kill", args=ARGS, nodes=2, host=hosts.coordinator)
    task = await start_job(client, job)
    address = await coordinator_of(job)
    # it listens on the job's address, not loopback
    assert address.rpartition(":")[0] == hosts.coordinator
    for h in hosts.hosts:
        hosts.start(
            h, node_argv(job, address, h, slots=2, spares=1), str(tmp_path / f"{h.name}.log")
        )
    kill = wire.Inject(action=wire.InjectAction.KILL, slot=3, after_step=20)
    before: wire.Status | None = None
    # Both nodes' spares warm before the kill: a rank is replaced on its own node when that node's
    # spare is ready (on a loaded machine a spare can still be starting at step 20, and then any
    # node's serves).
    while (
        before is None or len(before.ranks) < 4 or before.state != "training" or before.spares < 2
    ):
        assert not task.done(), (await task).error
        await asyncio.sleep(0.02)
        before = await status(job)
    # Each node holds two consecutive slots (the first to join 0 and 1).
    placed = {r.slot: r.node for r in before.ranks}
    assert placed[0] == placed[1] != placed[2] == placed[3], placed
    assert isinstance(await asyncio.to_thread(request, job.state_dir, job.job_id, kill), wire.Ok)
    after = await status(job)
    while after.incidents < 1 or after.state != "training" or len(after.ranks) < 4:
        assert not task.done(), (await task).error
        await asyncio.sleep(0.02)
        after = await status(job)
    result = await asyncio.wait_for(task, 150)

    moved = {r.slot: r for r in after.ranks}
    # a new process holds slot 3...
    assert moved[3].agent != {r.slot: r.agent for r in before.ranks}[3]
    assert moved[3].node == placed[3], after  # ...the spare of the node that lost it
    assert result.ok, (result.error, log_of(tmp_path, placed[3]))
    (outcome,) = result.incidents
    assert outcome.disposition is Disposition.MIGRATED and outcome.success, outcome
    assert outcome.lost_slots == (3,) and outcome.failure_domain == placed[3], outcome
    # Striped: the state came in slices from a replica on each node (slot 0's and slot 2's), each
    # slice verified against what its donor sent. A survivor still short of the frozen step takes
    # the state too and serves none (a ring all-reduce ends on the ranks at different moments: the
    # lost rank may have completed a step that a peer had not), so its node's next replica serves,
    # if it has one.
    assert outcome.proof is not None
    by_slot = {r.slot: r for r in outcome.proof.receivers}
    behind = set(by_slot) - {3}
    assert behind <= {0, 1, 2} and not behind & outcome.proof.donor_digests.keys(), outcome.proof
    firsts = (next((s for s in node if s not in behind), None) for node in ((0, 1), (2,)))
    donors = [s for s in firsts if s is not None]  # each node's first replica at the frozen step
    receiver = by_slot[3]
    assert [s.donor for s in receiver.stripes] == donors and receiver.dropped == (), (
        behind,
        receiver,
    )
    assert outcome.proof.donor_digests.keys() == set(donors), outcome.proof
    assert outcome.steps_recomputed == 0 == result.steps_recomputed
    assert result.final_digest == long_reference.final_digest


async def test_a_donor_lost_as_the_state_moves_leaves_the_other_nodes_replica_to_serve(
    client: Client, tmp_path: Path, hosts: Fabric, long_reference: JobResult
) -> None:
    """Two nodes of two ranks and a warm spare each. Rank 1 is killed; of the two donors (one
    replica per node: slots 0 and 2) slot 0 is killed as the transfer starts. The receiver takes
    every slice from slot 2, slot 0 becomes one more loss of the same incident and gets the other
    node's spare and the state in turn: migrated live, both slots moved, bitwise equal, nothing
    recomputed."""
    job = spec(tmp_path, "mn-donor", args=ARGS, nodes=2, host=hosts.coordinator)
    task = await start_job(client, job)
    address = await coordinator_of(job)
    for h in hosts.hosts:
        hosts.start(
            h, node_argv(job, address, h, slots=2, spares=1), str(tmp_path / f"{h.name}.log")
        )
    before: wire.Status | None = None
    while (
        before is None or len(before.ranks) < 4 or before.state != "training" or before.spares < 2
    ):
        assert not task.done(), (await task).error
        await asyncio.sleep(0.02)
        before = await status(job)
    donor = wire.Inject(
        action=wire.InjectAction.KILL, slot=0, during="transfer", target=wire.InjectTarget.DONOR
    )
    kill = wire.Inject(action=wire.InjectAction.KILL, slot=1, after_step=20)
    for req in (donor, kill):
        assert isinstance(await asyncio.to_thread(request, job.state_dir, job.job_id, req), wire.Ok)
    result = await asyncio.wait_for(task, 150)

    assert result.ok, result.error
    (outcome,) = result.incidents
    assert outcome.disposition is Disposition.MIGRATED and outcome.success, outcome
    assert outcome.lost_slots == (0, 1), outcome
    assert outcome.proof is not None and outcome.proof.lost_during == (0,), outcome.proof
    for r in outcome.proof.receivers:
        # slot 0 never served: all from the other node
        assert {s.donor for s in r.stripes} == {2}, r
    assert outcome.steps_recomputed == 0 == result.steps_recomputed
    assert result.final_digest == long_reference.final_digest


async def test_nodes_that_do_not_belong_are_refused_and_the_job_runs_on(
    client: Client, tmp_path: Path, hosts: Fabric, long_reference: JobResult
) -> None:
    """A node agent with the wrong secret, one started for another job, a second node under a name
    already taken and a node with slots joining once the job has all its nodes: each is refused with
    why (exit code 3), and the job trains on its two nodes to the same bits."""
    job = spec(tmp_path, "mn-refuse", args=ARGS, nodes=2, host=hosts.coordinator)
    task = await start_job(client, job)
    address = await coordinator_of(job)
    wrong = tmp_path / "wrong-secret"
    wrong.write_text("00" * 32)
    wrong.chmod(0o600)  # a copy open to others is refused before it reaches the coordinator
    a, b = hosts.hosts

    def attempt(log: str, host: Host, **kw: str) -> subprocess.Popen[bytes]:
        return hosts.start(
            host, node_argv(job, address, host, 2, 0, **kw), str(tmp_path / f"{log}.log")
        )

    strangers = {
        "wrong-secret": attempt("wrong-secret", a, secret=str(wrong), name="intruder"),
        "other-job": attempt("other-job", a, job_id="some-other-job", name="other"),
    }
    for name, p in strangers.items():
        assert await asyncio.to_thread(p.wait, 60) == EXIT_REFUSED, log_of(tmp_path, name)
    assert "refused" in log_of(tmp_path, "wrong-secret") and "some-other-job" in log_of(
        tmp_path, "other-job"
    )
    first = hosts.start(a, node_argv(job, address, a, 2, 1), str(tmp_path / "node0.log"))
    deadline = time.monotonic() + 30
    while "joined job" not in log_of(tmp_path, "node0"):
        assert time.monotonic() < deadline and first.poll() is None, log_of(tmp_path, "node0")
        await asyncio.sleep(0.05)
    twice = attempt("twice", b, name="node0")
    assert await asyncio.to_thread(twice.wait, 60) == EXIT_REFUSED
    assert "already joined" in log_of(tmp_path, "twice")
    hosts.start(b, node_argv(job, address, b, 2, 1), str(tmp_path / "node1.log"))
    # The job has all its nodes once node1 joined: a node coming then is late (asked as soon as
    # that, the late agent reads the job's secret well before a loaded machine could finish the job
    # and remove it).
    while "joined job" not in log_of(tmp_path, "node1"):
        assert not task.done(), (await task).error
        await asyncio.sleep(0.05)
    late = attempt("late", b, name="late")
    assert await asyncio.to_thread(late.wait, 60) == EXIT_REFUSED
    assert "hold every slot" in log_of(tmp_path, "late")

    result = await asyncio.wait_for(task, 150)
    assert result.ok and not result.incidents, result.error
    assert result.final_digest == long_reference.final_digest


@pytest.fixture
def three_hosts() -> Iterator[Fabric]:
    with fabric(3) as f:
        print(f"multi-node test hosts: {f.mode} ({', '.join(h.address for h in f.hosts)})")
        yield f


@pytest.mark.parametrize(
    ("lost", "how"),
    [(1, signal.SIGKILL), (0, signal.SIGKILL), (1, signal.SIGSTOP)],
    ids=["node-of-ranks-2-3", "node-of-rank-0", "node-hung"],
)
async def test_a_node_lost_whole_is_one_incident_and_the_spare_node_takes_its_slots(
    client: Client,
    tmp_path: Path,
    three_hosts: Fabric,
    long_reference: JobResult,
    lost: int,
    how: signal.Signals,
) -> None:
    """Two nodes of two ranks and a spare node with two warm spares. One training node's agent is
    SIGKILLed, its ranks die with it (their parent-death signal): every report of that loss folds
    into one incident whose lost slots are both of the node's, the spare node takes them, the state
    comes from the other node's replicas, and the run ends bitwise equal. Losing the node of rank 0
    is no different.

    A hung node (its agent and ranks SIGSTOPped: nothing on it can act or answer) is the same loss:
    its node is unheard past the node timeout, and all of it is fenced without its help: the
    coordinator shuts its connections, the survivors cut their side of the group (a collective
    waiting on a stopped peer would otherwise block until its timeout). Resumed after the run, its
    agent finds its coordinator gone and stops its processes, none of which rejoined."""
    hosts = three_hosts
    job = spec(
        tmp_path,
        f"mn-node-{lost}-{how}",
        args=ARGS,
        nodes=2,
        host=hosts.coordinator,
        node_timeout=3,
    )
    task = await start_job(client, job)
    address = await coordinator_of(job)
    a, b, spare = hosts.hosts
    agents = {}
    # The spare node first (it holds no slot), then node0 (slots 0 and 1) and node1 (slots 2 and 3).
    for h, held, spares in ((spare, 0, 2), (a, 2, 0), (b, 2, 0)):
        log = str(tmp_path / f"{h.name}.log")
        # A hung node, resumed after the job: its agent waits 2 s for a coordinator, then stops its
        # ranks.
        agents[h.name] = hosts.start(h, node_argv(job, address, h, held, spares, wait="2"), log)
        deadline = time.monotonic() + 30
        while "joined job" not in log_of(tmp_path, h.name):
            assert time.monotonic() < deadline, log_of(tmp_path, h.name)
            await asyncio.sleep(0.05)
    before = await status(job)
    # Lost once the world trains (a rank lost while the first group forms is another case).
    while (
        before.state != "training"
        or before.spares < 2
        or min((r.step for r in before.ranks), default=0) < 3
    ):
        assert not task.done(), (await task).error
        await asyncio.sleep(0.05)
        before = await status(job)
    victim = f"node{lost}"
    slots = tuple(r.slot for r in before.ranks if r.node == victim)
    assert len(slots) == 2, before
    hosts.stop(agents[victim], how)  # to the agent's whole session: the node is gone, or hung
    after = before
    while after.incidents < 1 or after.state != "training" or len(after.ranks) < 4:
        assert not task.done(), (await task).error
        await asyncio.sleep(0.05)
        after = await status(job)
    result = await asyncio.wait_for(task, 150)
    if how == signal.SIGSTOP:
        # the host is back: its agent leaves, ending its ranks
        hosts.stop(agents[victim], signal.SIGCONT)
        assert agents[victim].wait(30) == EXIT_COORDINATOR_LOST, log_of(tmp_path, victim)

    assert {r.slot: r.node for r in after.ranks if r.slot in slots} == dict.fromkeys(
        slots, "node2"
    ), after
    assert result.ok, result.error
    (outcome,) = result.incidents  # one incident for the node, however many reports it made
    assert outcome.disposition is Disposition.MIGRATED and outcome.success, outcome
    assert outcome.lost_slots == slots and outcome.failure_domain == victim, outcome
    # The node's own loss and its ranks' exits (those not fenced first), one incident: the brief's
    # "entire node failure". A hung node's ranks may be found hung before the node is: then the
    # incident is a hang.
    hung = how == signal.SIGSTOP
    assert outcome.kind is FailureKind.NODE_FAILURE or (
        hung and outcome.kind is FailureKind.HANG
    ), outcome
    # Both rows qualify: a node lost is the host row, a hang the interruption row.
    expected = (
        Category.HOST_GPU_FABRIC
        if outcome.kind is FailureKind.NODE_FAILURE
        else Category.INTERRUPTION
    )
    assert outcome.classification.category is expected and outcome.classification.qualifying, (
        outcome
    )
    assert outcome.steps_recomputed == 0 == result.steps_recomputed
    assert result.final_digest == long_reference.final_digest


async def test_a_node_lost_with_no_spare_anywhere_is_disqualified_and_restarts_from_the_checkpoint(
    client: Client, tmp_path: Path, hosts: Fabric, long_reference: JobResult
) -> None:
    """Two nodes of two ranks, no warm spare anywhere: a node lost whole is the brief's "spare
    resources not available" (disqualified, recorded), and the job falls back to a checkpoint
    restart on the node left, which ends bitwise equal with the recomputed steps counted."""
    job = spec(tmp_path, "mn-no-spare", args=ARGS, nodes=2, host=hosts.coordinator, spares=0)
    task = await start_job(client, job)
    address = await coordinator_of(job)
    agents = {}
    for h in hosts.hosts:
        agents[h.name] = hosts.start(
            h, node_argv(job, address, h, 2, 0), str(tmp_path / f"{h.name}.log")
        )
    before = await status(job)
    while (
        before.state != "training"
        or len(before.ranks) < 4
        or min(r.step for r in before.ranks) < 30
    ):
        assert not task.done(), (await task).error
        await asyncio.sleep(0.05)
        before = await status(job)
    victim = before.ranks[3].node
    hosts.stop(agents[victim])
    result = await asyncio.wait_for(task, 150)

    assert result.ok, result.error
    (outcome,) = result.incidents
    assert outcome.disposition is Disposition.FALLBACK_RESTART and not outcome.success, outcome
    assert not outcome.classification.qualifying, outcome.classification
    assert outcome.failure_domain == victim and len(outcome.lost_slots) == 2, outcome
    assert outcome.fallback is not None and outcome.fallback.restored_step >= 19, outcome.fallback
    assert result.steps_recomputed == outcome.steps_recomputed > 0
    assert result.final_digest == long_reference.final_digest
