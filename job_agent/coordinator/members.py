"""The coordinator's view of the job's processes: each member from its hello to its loss, and the
roster.

Every field is what a process said of itself over the control channel (or what the coordinator saw
of its connection); nothing here is assumed.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field

from job_agent import wire
from job_agent.coordinator.answers import TransferAnswers
from job_agent.coordinator.channel import send
from job_agent.coordinator.clock import SYSTEM, Clock
from job_agent.wire.operator import MemberState, RankStatus
from job_agent.wire.rank import Role
from torchpass.incident.classify import CATEGORY_OF
from torchpass.models import Category, Evidence


@dataclass
class Member:
    """A rank or spare process. Monotonic times are the coordinator's; `step_wall` is wall-clock."""

    agent_id: str
    role: Role
    slot: int
    pid: int
    node: str
    conn: socket.socket | None = None
    device: int = -1  # its GPU index on its node (LOCAL_RANK), as it said in its hello
    environment: wire.Environment | None = None  # what its torch offers, as it said in its hello
    state: MemberState = MemberState.CONNECTED
    last_heartbeat: float = field(default_factory=time.monotonic)
    # its last step or collective entry
    last_progress: float = field(default_factory=time.monotonic)
    step: int = -1
    step_wall: float = 0.0
    busy: str | None = None  # what it said it is busy with (`agent.busy`), until it says it is done
    collective_step: int = -1
    collective_at: float = 0.0
    completed: int = -1
    frozen_at: float | None = None  # when it reported "frozen" while the job was training
    fenced: bool = False
    # A planned move's rank once frozen: out of the world (its slot is the spare's), alive to give
    # its state.
    leaving: bool = False
    reserved_for: str | None = None
    layout: wire.ShardLayout | None = None
    digest: str | None = None
    joined: wire.Joined | None = None  # where it said it stands in the newest generation it formed
    device_error: wire.DeviceError | None = None  # the device error it reported, if it did
    answers: TransferAnswers | None = None  # its answers to the transfer it was last commanded in
    bytes_moved: int = 0  # state bytes a transfer has streamed so far, as the donor reports them
    redo: int | None = None  # the step it said it does again (its in-flight step as it froze)
    redone: wire.Redone | None = None  # its verdict on the last step it did again

    @property
    def alive(self) -> bool:
        return self.state is not MemberState.LOST

    def status(self) -> RankStatus:
        """What `torchpass status` shows of it: where it runs and how far it got."""
        return RankStatus(
            slot=self.slot,
            agent=self.agent_id,
            state=self.state,
            step=self.step,
            node=self.node,
            pid=self.pid,
            device=self.device,
        )

    def send(self, frame: wire.Frame) -> None:
        if self.conn is not None:
            send(self.conn, frame)

    def observe(self, frame: wire.Frame, now: float, wall: float) -> None:
        """What a frame from this process says about it (any frame is a sign of life)."""
        self.last_heartbeat = now
        match frame:
            case wire.Step(k=k):
                self.step, self.last_progress, self.step_wall, self.state = (
                    k,
                    now,
                    wall,
                    MemberState.TRAINING,
                )
                self.completed, self.frozen_at = k - 1, None
            case wire.Collective(k=k):
                self.collective_step, self.collective_at, self.last_progress = k, now, now
            case wire.Busy(what=what, busy=busy):
                self.busy = what if busy else None
            case wire.Ready(completed=c):
                self.state, self.completed = MemberState.READY, c
            case wire.Frozen(completed=c, in_flight=k):
                self.state, self.completed = MemberState.FROZEN, c
                self.frozen_at = self.frozen_at or now
                if k is not None:
                    self.redo, self.redone = k, None
            case wire.Redone():
                self.redone = frame
            case wire.Joined():
                self.state, self.collective_step, self.joined = MemberState.JOINED, -1, frame
            case wire.Done(step=step, digest=digest):
                # A rank with no step left to run (restored at the job's end) resumes by finishing.
                self.state, self.completed, self.digest, self.step_wall = (
                    MemberState.DONE,
                    step,
                    digest,
                    wall,
                )
            case wire.TransferProgress(bytes=n):
                self.bytes_moved = n
            case wire.DeviceError():
                self.device_error = frame
            case wire.Serving() | wire.Served() | wire.Received() | wire.TransferFailed():
                if self.answers is not None:
                    self.answers.take(frame)


@dataclass(frozen=True)
class Pending:
    """A process launched and not yet connected: where it runs and what it was started as."""

    node: str
    role: Role


class Roster:
    """Every process of the job: launched and not yet connected (`pending`), and connected
    (`members`)."""

    def __init__(self, clock: Clock = SYSTEM) -> None:
        self.clock = clock
        self.members: dict[str, Member] = {}
        self.pending: dict[str, Pending] = {}  # launched, not yet connected
        self._by_conn: dict[socket.socket, Member] = {}
        self.shards: dict[int, str] = {}  # slot -> shard its rank last reported holding
        # slot -> the state its rank was seen carrying from step to step, undeclared (`Carries`)
        self.carries: dict[int, str] = {}
        # slot -> the process found holding another state than its replicas
        self.suspects: dict[int, str] = {}

    def admit(self, conn: socket.socket, hello: wire.Hello) -> Member | None:
        """The member a hello announces, or None when no such process was launched (or it was
        fenced)."""
        launched = self.pending.pop(hello.agent_id, None)
        if launched is None:
            return None
        m = Member(
            hello.agent_id,
            hello.role,
            hello.slot,
            hello.pid,
            launched.node,
            conn,
            device=hello.device,
            environment=hello.environment,
            last_heartbeat=self.clock.monotonic(),
            last_progress=self.clock.monotonic(),
        )
        self.members[m.agent_id] = m
        self._by_conn[conn] = m
        return m

    def of(self, conn: socket.socket) -> Member | None:
        return self._by_conn.get(conn)

    def closed(self, conn: socket.socket) -> Member | None:
        return self._by_conn.pop(conn, None)

    def ranks(self, *states: MemberState) -> list[Member]:
        """Live members holding a slot (optionally in given states), by slot."""
        out = [
            m
            for m in self.members.values()
            if m.slot >= 0 and m.alive and not m.leaving and (not states or m.state in states)
        ]
        return sorted(out, key=lambda m: m.slot)

    def departing(self) -> list[Member]:
        """Live ranks a planned move took out of the world, kept until their state has moved, by
        slot."""
        return sorted(
            (m for m in self.members.values() if m.leaving and m.alive), key=lambda m: m.slot
        )

    def at(self, slot: int) -> Member | None:
        return next((m for m in self.ranks() if m.slot == slot), None)

    def is_spare(self, agent_id: str) -> bool:
        """Started as a spare (connected or not yet) and not given a slot since."""
        m = self.members.get(agent_id)
        if m is not None:
            return m.role is Role.SPARE
        launched = self.pending.get(agent_id)
        return launched is not None and launched.role is Role.SPARE

    def finished(self, world_size: int) -> bool:
        """Every slot's rank has done every step."""
        ranks = self.ranks()
        return len(ranks) == world_size and all(m.state is MemberState.DONE for m in ranks)

    def home(self, slot: int) -> str | None:
        """The node of the last process that held `slot`, alive or lost: where its replacement
        belongs."""
        return next((m.node for m in reversed(self.members.values()) if m.slot == slot), None)

    def record_layout(self, m: Member, layout: wire.ShardLayout | None) -> None:
        if layout is not None:
            m.layout = layout
            if m.slot >= 0:
                self.shards[m.slot] = layout.shard

    def holders(self, ev: Evidence) -> tuple[str, ...]:
        """The live processes holding the slots `ev` names, now."""
        return tuple(m.agent_id for s in ev.slots if (m := self.at(s)) is not None)

    def repaired(self, ev: Evidence, concerned: tuple[str, ...] = ()) -> bool:
        """Whether the failure `ev` reports is already repaired (say by a restart) or the planned
        move it asks for already made: every slot it names is held by a live process, off the
        drained node for a planned one, and not the one it concerned (`concerned`: the processes
        holding its slots when it came; a GPU report about a rank that has not died yet stands while
        that rank lives), nor the one found holding another state than its replicas."""
        planned = CATEGORY_OF[ev.kind] is Category.PLANNED
        members = [self.at(s) for s in ev.slots]
        return bool(members) and all(
            m is not None
            and not m.fenced
            and not (planned and m.node == ev.failure_domain)
            and m.agent_id not in concerned
            # a corrupted replica is alive, not repaired
            and self.suspects.get(m.slot) != m.agent_id
            for m in members
        )
