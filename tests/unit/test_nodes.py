"""The coordinator's side of a multi-node job (`job_agent.coordinator.node_launcher.NodeLauncher`)
and the node frames, over real sockets: which node is admitted, where each process goes, what a
node's loss or its word means."""

from __future__ import annotations

import signal
import socket
from collections.abc import Iterator

import pytest

from job_agent import wire
from job_agent.coordinator.members import Pending, Roster
from job_agent.coordinator.node_admission import admit_node
from job_agent.coordinator.node_launcher import NodeLauncher
from job_agent.wire import protocol
from job_agent.wire.node import NodeProcess
from job_agent.wire.rank import Role


def hello(node: str, slots: int, spares: int = 0, job: str = "job-1") -> wire.NodeHello:
    return wire.NodeHello(
        job_id=job, node=node, host=f"198.18.0.{len(node)}", slots=slots, spares=spares, pid=1
    )


def env(role: str, slot: int) -> dict[str, str]:
    return {"TORCHPASS_ROLE": role, "TORCHPASS_SLOT": str(slot)}


class Nodes:
    """A NodeLauncher and, for each node, the far end of its connection (what the node agent
    reads)."""

    def __init__(self, expected: int) -> None:
        self.ranks: set[str] = set()  # spares given a slot
        self.launcher = NodeLauncher(
            "job-1", expected, lambda a: a.startswith("spare") and a not in self.ranks
        )
        self.conns: dict[str, tuple[socket.socket, socket.socket]] = {}

    def join(self, h: wire.NodeHello) -> str | None:
        near, far = socket.socketpair()
        self.conns[h.node] = (near, far)
        return self.launcher.join(near, h)

    def received(self, node: str) -> wire.Frame:
        far = self.conns[node][1]
        far.settimeout(5)
        return protocol.recv_frame(far)

    def close(self) -> None:
        for near, far in self.conns.values():
            near.close()
            far.close()


@pytest.fixture
def nodes() -> Iterator[Nodes]:
    n = Nodes(expected=2)
    try:
        yield n
    finally:
        n.close()


def test_nodes_that_do_not_belong_are_refused_with_why(nodes: Nodes) -> None:
    assert (
        nodes.join(hello("a", 2, job="job-2"))
        == "node a is started for job job-2, this is job job-1"
    )
    assert nodes.join(hello("a", 2)) is None
    assert "already joined" in (nodes.join(hello("a", 2)) or "")
    # a spare node is not one of the two awaited
    assert nodes.join(hello("spare", 0, spares=2)) is None
    assert not nodes.launcher.ready_for(4)
    assert nodes.join(hello("b", 2)) is None
    assert nodes.launcher.ready_for(4)
    assert "hold every slot" in (nodes.join(hello("c", 2)) or "")
    assert nodes.join(hello("spare2", 0)) is None  # spare nodes may come at any time


def test_a_job_on_one_host_takes_no_node_agent() -> None:
    near, far = socket.socketpair()
    with near, far:
        reply = admit_node(None, Roster(), near, hello("a", 2), lambda: None)
    assert isinstance(reply, wire.Reject) and "one host" in reply.reason


def test_ranks_go_to_the_node_holding_their_slot_and_spares_where_they_are_missing(
    nodes: Nodes,
) -> None:
    for h in (hello("a", 2, spares=1), hello("b", 2, spares=1), hello("s", 0, spares=2)):
        assert nodes.join(h) is None
    launcher = nodes.launcher
    placed = {f"rank{s}": launcher.spawn(f"rank{s}", env("rank", s)) for s in range(4)}
    assert placed == {"rank0": "a", "rank1": "a", "rank2": "b", "rank3": "b"}
    spares = [launcher.spawn(f"spare-{i}", env("spare", -1)) for i in range(4)]
    assert sorted(spares) == ["a", "b", "s", "s"]  # each node up to the spares it announced
    # a's spare took a slot: a is the node a spare short
    nodes.ranks.add(f"spare-{spares.index('a')}")
    assert launcher.spawn("spare-4", env("spare", -1)) == "a"
    first = nodes.received("a")
    assert (
        isinstance(first, wire.Spawn) and first.agent_id == "rank0" and first.env == env("rank", 0)
    )


def test_a_lost_node_has_lost_every_process_and_its_slots_go_to_a_spare_node(nodes: Nodes) -> None:
    for h in (hello("a", 2), hello("b", 2), hello("s", 0, spares=2)):
        assert nodes.join(h) is None
    launcher = nodes.launcher
    for s in range(4):
        launcher.spawn(f"rank{s}", env("rank", s))
    notified: list[int] = []
    lost = launcher.closed(nodes.conns["b"][0], lambda: notified.append(1))
    assert lost is not None and lost.name == "b"
    assert notified == [1]
    assert launcher.poll("rank2") == launcher.poll("rank3") == -int(signal.SIGKILL)
    assert launcher.poll("rank0") is None
    assert launcher.spawn("rank2-again", env("rank", 2)) == "s"  # its home is gone: the spare node
    assert launcher.closed(nodes.conns["a"][1], lambda: None) is None  # not a node's connection


def test_a_node_speaks_only_of_its_own_processes(nodes: Nodes) -> None:
    for h in (hello("a", 2), hello("b", 2)):
        assert nodes.join(h) is None
    launcher = nodes.launcher
    launcher.spawn("rank0", env("rank", 0))
    b = nodes.conns["b"][0]
    assert launcher.heard(b, wire.Exited(agent_id="rank0", code=-9))
    assert launcher.poll("rank0") is None  # b does not run rank0
    a = nodes.conns["a"][0]
    assert launcher.heard(a, wire.Exited(agent_id="rank0", code=-9))
    assert launcher.poll("rank0") == -9
    assert launcher.heard(a, wire.Step(k=3))  # not a node's frame: answered with a typed error
    err = protocol.recv_frame(nodes.conns["a"][1])
    while isinstance(err, wire.Spawn):
        err = protocol.recv_frame(nodes.conns["a"][1])
    assert isinstance(err, wire.Error) and "does not send 'step'" in err.reason
    other, _ = socket.socketpair()
    with other, _:
        assert not launcher.heard(other, wire.Heartbeat())  # not a node: the coordinator's business


@pytest.mark.parametrize(
    "body",
    [
        b'{"t": "spawn", "agent_id": "rank0", "env": {"LD_PRELOAD": "/tmp/x.so"}}',
        b'{"t": "spawn", "agent_id": "rank0", "env": {"TORCHPASS_X": "' + b"v" * 5000 + b'"}}',
        b'{"t": "node_hello", "job_id": "../etc", "node": "a", "host": "h", "slots": 1, '
        b'"spares": 0, "pid": 1}',
        b'{"t": "signal", "agent_id": "rank0", "action": "format-disk"}',
    ],
    ids=["not-an-agent-setting", "oversized-setting", "bad-job-id", "unknown-signal"],
)
def test_a_malformed_node_frame_never_decodes(body: bytes) -> None:
    with pytest.raises(wire.BadFrame):
        wire.decode(body)


def test_a_node_rejoins_only_a_coordinator_taking_its_job_back(nodes: Nodes) -> None:
    """A rejoin tells what the node runs and what ended while it had no coordinator. A live
    coordinator that lost the node refuses it (its processes were fenced); a restarted one taking
    the job back (`job_agent.coordinator.takeback`) admits it, its running processes may rejoin, the
    ended ones are losses."""
    procs = (
        NodeProcess(agent_id="rank2-3", slot=2),
        NodeProcess(agent_id="rank3-4", slot=3, code=-9),
        NodeProcess(agent_id="spare-17", slot=-1),
    )
    back = hello("b", 2).model_copy(update={"rejoin": True, "first_slot": 2, "processes": procs})
    assert "was lost to the job" in (nodes.join(back) or "")
    nodes.launcher.rejoining = True
    near, far = socket.socketpair()
    nodes.conns["b"] = (near, far)
    roster = Roster()
    assert isinstance(admit_node(nodes.launcher, roster, near, back, lambda: None), wire.Welcome)
    assert roster.pending == {
        "rank2-3": Pending("b", Role.RANK),
        "spare-17": Pending("b", Role.SPARE),
    }  # running: each may say hello again
    launcher = nodes.launcher
    assert launcher.poll("rank3-4") == -9 and launcher.poll("rank2-3") is None
    assert launcher.ended_in(3) == ("b", -9) and launcher.ended_in(2) == ("b", None)
    assert launcher.highest_agent_number() == 17  # new agents are numbered past every rejoined one
    assert launcher.node_of("spare-17") == "b"


def test_a_nodes_gpu_report_counts_only_for_its_own_ranks(nodes: Nodes) -> None:
    """A node's GPU report is a claim: the launcher keeps only the processes that node runs, and the
    detector acts only on those that are training ranks of the job there (a spare, a fenced rank,
    another node's rank or a process the job never started starts nothing)."""
    from datetime import timedelta

    from job_agent.coordinator.detect.detection import Detector
    from job_agent.coordinator.members import Member
    from torchpass.models import EventSource, FailureKind

    launcher = nodes.launcher
    for n in ("a", "b"):
        assert nodes.join(hello(n, 2, spares=1)) is None
    placed = {f"rank{s}": launcher.spawn(f"rank{s}", env("rank", s)) for s in range(4)}
    placed["spare-0"] = launcher.spawn("spare-0", env("spare", -1))
    a_conn = nodes.conns["a"][0]

    def report(*agents: str, planned: bool = False) -> wire.GpuReport:
        kind = FailureKind.GPU_TEMPERATURE if planned else FailureKind.GPU_FELL_OFF_BUS
        return wire.GpuReport(
            gpu=0, agent_ids=agents, kind=kind, planned=planned, detail="GPU 0: XID 79", xid=79
        )

    others = [a for a, n in placed.items() if n == "b"]
    assert launcher.heard(a_conn, report(*others, "stranger"))  # nothing of node a's: kept nowhere
    assert launcher.gpu_reports == []
    mine = [a for a, n in placed.items() if n == "a"]
    assert launcher.heard(a_conn, report(*mine, *others))
    [(node, kept)] = launcher.gpu_reports
    assert node == "a" and set(kept.agent_ids) == set(mine)

    roster = Roster()
    for agent, n in placed.items():
        slot = int(agent[4:]) if agent.startswith("rank") else -1
        roster.members[agent] = Member(
            agent, wire.Role.RANK if slot >= 0 else wire.Role.SPARE, slot, 1, n
        )
    detect = Detector("job-1", roster, timedelta(seconds=10))
    ev, ranks = detect.gpu("a", kept)
    assert (
        ev is not None and ev.source is EventSource.NVML and ev.kind is FailureKind.GPU_FELL_OFF_BUS
    )
    assert (
        ev.failure_domain == "a"
        and ev.xid == 79
        and ev.slots == tuple(sorted(m.slot for m in ranks))
    )
    assert {m.agent_id for m in ranks} == {a for a in mine if a.startswith("rank")}  # not the spare
    for m in ranks:
        m.fenced = True
    assert detect.gpu("a", kept) == (None, [])  # fenced: already lost, not reported twice
    warning = report(*others, planned=True)
    assert detect.gpu("a", warning) == (None, [])  # node a cannot speak for node b's ranks
    ev, _ = detect.gpu("b", warning)
    assert ev is not None and ev.kind is FailureKind.NODE_DRAIN and "pre-emptively" in ev.detail


def test_a_spawn_sets_the_agents_settings_and_torchruns_names_and_nothing_else() -> None:
    """A coordinator's spawn is a node agent's environment for a process it starts: the agent's
    settings and torchrun's names for the worker (libraries such as accelerate read them), never
    what would change what the process runs."""
    ok = wire.Spawn(agent_id="rank1-2", env={"TORCHPASS_SLOT": "1", "RANK": "1", "WORLD_SIZE": "4"})
    assert ok.env["RANK"] == "1"
    for name in ("LD_PRELOAD", "PATH", "PYTHONPATH", "RANKS"):
        with pytest.raises(ValueError, match="not an agent setting"):
            wire.Spawn(agent_id="rank1-2", env={"TORCHPASS_SLOT": "1", name: "x"})
