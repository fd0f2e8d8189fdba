"""A job's node agents as its coordinator sees them: a launcher whose processes run on other hosts.

A node agent (`torchpass node`, `job_agent.node.agent`) joins its job over the control channel with
a `NodeHello`: its name, the address its processes advertise to their peers, how many ranks (slots)
and warm spares it runs. Nodes that bring slots get the next ones in the order they join (node 0
slots 0..P-1, and so on); a node with none is a spare node. The coordinator places every process it
starts on a node and tells that node to start it (`Spawn`); the node answers each exit (`Exited`)
and carries out fencing and injected stops (`Signal`). A process's failure domain is its node.

Where a process goes: a rank to the node that holds its slot while that node is there, else to a
spare node, else to the node running the fewest of the job's processes; a spare to the node furthest
below the warm spares it announced. A node's processes are started under a parent-death signal, so a
node agent whose connection closed has lost them all: each counts as killed.
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from job_agent import wire
from job_agent.coordinator.channel import send
from job_agent.coordinator.clock import SYSTEM, Clock
from job_agent.coordinator.private_files import replace_private
from job_agent.launch.launcher import Launcher
from job_agent.wire.node import NodeProcess, SignalAction
from job_agent.wire.rank import Role
from torchpass.errors import ErrorType

_KILLED = -int(signal.SIGKILL)
MAX_ROLL = 4096  # node names read back from a lost coordinator's roll
log = logging.getLogger("torchpass.coordinator")


@dataclass
class Node:
    name: str
    host: str
    slots: int
    spares: int
    first_slot: int
    conn: socket.socket
    alive: bool = True
    last_heard: float = field(default_factory=time.monotonic)
    placed: set[str] = field(default_factory=set)  # the agents started on it
    lost_why: str = "its agent's connection closed"
    # what it ran, as it said rejoining a restarted coordinator
    rejoined: tuple[NodeProcess, ...] = ()


MAX_GPU_REPORTS = 64  # a node's reports waiting: one repeating itself cannot grow the coordinator


class NodeLauncher(Launcher):
    """Processes on the job's node agents. Touched on the coordinator's loop, and by `shutdown` from
    a thread: a lock keeps the two apart."""

    def __init__(
        self,
        job_id: str,
        expected: int,
        is_spare: Callable[[str], bool],
        job_dir: Path | None = None,
        clock: Clock = SYSTEM,
    ) -> None:
        self.job_id = job_id
        self.clock = clock  # when each node was last heard, and when it counts as silent
        # The names of the nodes that joined, spare nodes included: a restarted coordinator waits
        # for them.
        self._roll = job_dir / "nodes.json" if job_dir is not None else None
        self.expected = expected
        self._is_spare = is_spare  # a spare given a slot is a rank now: its node is a spare short
        self.nodes: dict[str, Node] = {}
        self._by_conn: dict[socket.socket, Node] = {}
        self._node_of: dict[str, Node] = {}  # agent -> its node
        self._exits: dict[str, int] = {}
        # What nodes' GPUs said of their own processes, for the coordinator's watch to act on.
        self.gpu_reports: list[tuple[str, wire.GpuReport]] = []
        # What nodes said of their hosts (a filesystem, their memory): set by the coordinator.
        self.on_host: Callable[[str, wire.HostReport], None] = lambda node, report: None
        self._lock = threading.Lock()
        self._closed = False
        # the job's processes were started: a node joining now brings its spares
        self.started = False
        self.rejoining = False  # a restarted coordinator takes the job back: its nodes may rejoin
        # cordoned, drained or lost per the cluster: nothing new starts there
        self.avoid: set[str] = set()

    # --- nodes joining and leaving
    # --------------------------------------------------------------------

    def join(self, conn: socket.socket, hello: wire.NodeHello) -> str | None:
        """Admit a node agent; the reason it is refused, or None."""
        with self._lock:
            if hello.job_id != self.job_id:
                return (
                    f"node {hello.node} is started for job {hello.job_id}, this is job "
                    f"{self.job_id}"
                )
            if hello.node in self.nodes:
                return f"a node named {hello.node} already joined this job"
            if self._closed:
                return "the job has ended"
            if hello.rejoin:
                return self._rejoin(conn, hello)
            if hello.slots and sum(1 for n in self.nodes.values() if n.slots) >= self.expected:
                return (
                    f"the job's {self.expected} nodes have joined and hold every slot: join with "
                    "no slots"
                )
            first = sum(n.slots for n in self.nodes.values())
            node = Node(hello.node, hello.host, hello.slots, hello.spares, first, conn)
            node.last_heard = self.clock.monotonic()
            self.nodes[node.name] = node
            self._by_conn[conn] = node
            self._write_roll()
            return None

    def _write_roll(self) -> None:
        if self._roll is None:
            return
        replace_private(self._roll, json.dumps(sorted(self.nodes)))

    def roll(self) -> set[str]:
        """The nodes a lost coordinator of this job had (empty when it left no readable roll)."""
        if self._roll is None:
            return set()
        try:
            names = json.loads(self._roll.read_text())
        except (OSError, ValueError):
            return set()
        if not isinstance(names, list):
            return set()
        return {n for n in names[:MAX_ROLL] if isinstance(n, str)}

    def _rejoin(self, conn: socket.socket, hello: wire.NodeHello) -> str | None:
        """A node back to a restarted coordinator, with what it runs
        (`job_agent.coordinator.takeback`). Refused by a coordinator that is not taking its job
        back: one that lost the node fenced what it ran."""
        if not self.rejoining:
            return (
                f"node {hello.node} cannot rejoin: it was lost to the job, and its processes fenced"
            )
        node = Node(hello.node, hello.host, hello.slots, hello.spares, hello.first_slot, conn)
        node.last_heard = self.clock.monotonic()
        node.rejoined = hello.processes
        for p in hello.processes:
            node.placed.add(p.agent_id)
            self._node_of[p.agent_id] = node
            if p.code is not None:
                self._exits[p.agent_id] = p.code
        self.nodes[node.name] = node
        self._by_conn[conn] = node
        return None

    def highest_agent_number(self) -> int:
        """The largest number ending an agent id the rejoined nodes run: new ids are numbered past
        it."""
        numbers = [a.rpartition("-")[2] for a in self._node_of]
        return max((int(n) for n in numbers if n.isdigit()), default=0)

    def ended_in(self, slot: int) -> tuple[str, int | None]:
        """The node that held `slot`, and the exit status of the process it last started for it
        (None: it did not say one ended)."""
        holder = next(
            (n for n in self.joined() if n.first_slot <= slot < n.first_slot + n.slots), None
        )
        for n in self.joined():
            for p in reversed(n.rejoined):
                if p.slot == slot and p.code is not None:
                    return n.name, p.code
        return (holder.name if holder else "unknown"), None

    def heard(self, conn: socket.socket, frame: wire.Frame) -> bool:
        """Whether `conn` is a node agent's: then its frame is taken (and answered) here."""
        node = self._by_conn.get(conn)
        if node is None:
            return False
        node.last_heard = self.clock.monotonic()
        if isinstance(frame, wire.Exited):
            if self._node_of.get(frame.agent_id) is node:  # a node speaks only of its own processes
                self._exits.setdefault(frame.agent_id, frame.code)
        elif isinstance(frame, wire.GpuReport):
            mine = tuple(a for a in frame.agent_ids if self._node_of.get(a) is node)
            queued = sum(1 for name, _ in self.gpu_reports if name == node.name)
            # per node: one node's flood never drops another's
            if mine and queued < MAX_GPU_REPORTS:
                self.gpu_reports.append((node.name, frame.model_copy(update={"agent_ids": mine})))
        elif isinstance(frame, wire.HostReport):
            mine = tuple(a for a in frame.agent_ids if self._node_of.get(a) is node)
            if mine or not frame.agent_ids:  # a node speaks of itself and of its own processes only
                self.on_host(node.name, frame.model_copy(update={"agent_ids": mine}))
        elif not isinstance(frame, wire.Heartbeat):
            send(
                conn,
                wire.Error(
                    code=ErrorType.UNKNOWN_FRAME, reason=f"a node agent does not send {frame.t!r}"
                ),
            )
        return True

    def closed(self, conn: socket.socket, notify: Callable[[], None]) -> Node | None:
        """The node whose agent's connection `conn` was, if any. Its closing means the node and
        every process it ran are gone."""
        with self._lock:
            node = self._by_conn.pop(conn, None)
            if node is None:
                return None
            node.alive = False
            for agent in node.placed:
                self._exits.setdefault(agent, _KILLED)
        notify()
        return node

    def silent(self, timeout: timedelta) -> list[Node]:
        """Live nodes not heard from for `timeout`: hung, or cut off from the coordinator."""
        now = self.clock.monotonic()
        return [n for n in self.joined() if now - n.last_heard > timeout.total_seconds()]

    def joined(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.alive]

    def ready_for(self, world_size: int) -> bool:
        """Every expected node (one with slots: spare nodes come as they please) joined, and
        together they hold every slot."""
        live = [n for n in self.joined() if n.slots]
        return len(live) >= self.expected and sum(n.slots for n in live) >= world_size

    def warm_spares(self) -> int:
        """The warm spares the joined nodes run between them."""
        return sum(n.spares for n in self.joined())

    # --- Launcher
    # --------------------------------------------------------------------------------------

    def spawn(self, agent_id: str, env: Mapping[str, str]) -> str:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"not starting {agent_id}: the job is shutting down")
            node = self._place(Role(env["TORCHPASS_ROLE"]), int(env["TORCHPASS_SLOT"]))
            node.placed.add(agent_id)
            self._node_of[agent_id] = node
        send(node.conn, wire.Spawn(agent_id=agent_id, env=dict(env)))
        return node.name

    def _place(self, role: Role, slot: int) -> Node:
        live = self.joined()
        if not live:
            raise RuntimeError("no node agent is connected to start a process on")
        usable = [n for n in live if n.name not in self.avoid]
        if not usable and role is Role.SPARE:
            raise RuntimeError("every node is cordoned, drained or lost: no spare starts")
        live = usable or live  # a rank restarted from a checkpoint still needs somewhere to run

        def running(n: Node) -> int:
            return sum(1 for a in n.placed if a not in self._exits)

        if role is Role.RANK:
            home = [n for n in live if n.first_slot <= slot < n.first_slot + n.slots]
            spare_nodes = [n for n in live if n.slots == 0]
            return (home or spare_nodes or sorted(live, key=running))[0]

        def deficit(n: Node) -> int:
            return n.spares - sum(1 for a in n.placed if self._is_spare(a) and a not in self._exits)

        return max(live, key=lambda n: (deficit(n), -running(n)))

    def _signal(self, agent_id: str, action: SignalAction) -> None:
        node = self._node_of.get(agent_id)
        if node is not None and node.alive:
            send(node.conn, wire.Signal(agent_id=agent_id, action=action))

    def kill(self, agent_id: str) -> None:
        self._signal(agent_id, SignalAction.KILL)

    def suspend(self, agent_id: str) -> None:
        self._signal(agent_id, SignalAction.STOP)

    def resume(self, agent_id: str) -> None:
        self._signal(agent_id, SignalAction.CONT)

    def poll(self, agent_id: str) -> int | None:
        return self._exits.get(agent_id)

    def pid(self, agent_id: str) -> int | None:
        return None  # a process on another host: its node knows it

    def node_of(self, agent_id: str) -> str | None:
        node = self._node_of.get(agent_id)
        return None if node is None else node.name

    def shutdown(self, timeout: timedelta) -> None:
        """Every node stops its processes (terminate, then kill past its grace) and leaves."""
        with self._lock:
            self._closed = True
            nodes = self.joined()
        for n in nodes:
            send(n.conn, wire.Exit(code=0, reason="the job has ended"))
        deadline = time.monotonic() + timeout.total_seconds() + 5
        while time.monotonic() < deadline and any(n.alive for n in nodes):
            time.sleep(0.05)
