"""What each frame that reaches the coordinator does: a member's progress and its answers, a hello,
a node agent's word, an operator's or a cluster detector's request, and a connection that closed.

Called on the coordinator's event loop by its control channel (`channel.py`), one frame at a time,
so the coordinator's state has one writer.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Protocol

from job_agent import wire
from job_agent.coordinator.channel import send
from job_agent.coordinator.clock import Clock
from job_agent.coordinator.detect.cluster import ClusterSignals
from job_agent.coordinator.detect.detection import Detector
from job_agent.coordinator.detect.injection import Injector
from job_agent.coordinator.detect.replicas import ReplicaChecks
from job_agent.coordinator.ending import user_error
from job_agent.coordinator.incident.tracker import IncidentTracker
from job_agent.coordinator.members import Member, Roster
from job_agent.coordinator.node_admission import admit_node
from job_agent.coordinator.node_launcher import NodeLauncher
from job_agent.coordinator.progress import StepTracker
from job_agent.coordinator.resume import Checkpoints
from job_agent.coordinator.spares import SparePool
from job_agent.coordinator.waiting import Changes
from job_agent.launch.launcher import Launcher, signal_name
from job_agent.wire.operator import MemberState
from job_agent.wire.rank import Role
from torchpass.errors import ErrorType
from torchpass.job import JobState
from torchpass.models import Evidence

log = logging.getLogger("torchpass.coordinator")
ENDED = (JobState.FINISHED, JobState.FAILED, JobState.USER_ERROR, JobState.STOPPED)
_NOT_FROM_MEMBERS = (
    wire.Hello,
    wire.NodeHello,
    wire.Inject,
    wire.Drain,
    wire.NodeEvent,
    wire.StatusRequest,
)


class Job(Protocol):
    """What the handlers read and do of the job (its coordinator)."""

    job_id: str
    world_size: int
    state: JobState
    clock: Clock
    roster: Roster
    nodes: NodeLauncher | None
    launcher: Launcher
    spares: SparePool
    changes: Changes
    progress: StepTracker
    checkpoints: Checkpoints
    replicas: ReplicaChecks
    detector: Detector
    cluster: ClusterSignals
    injector: Injector
    incidents: IncidentTracker
    launching: bool
    tasks: set[asyncio.Task[None]]

    @property
    def generation(self) -> int: ...
    def fail(self, error: str | None, state: JobState = ...) -> None: ...
    def add_evidence(self, ev: Evidence) -> None: ...
    def spawn(self, role: Role, slot: int, restore: str | None = None) -> str: ...


class Inbound:
    """The coordinator's handlers of its control channel."""

    def __init__(self, c: Job) -> None:
        self.c = c

    def on_frame(self, conn: socket.socket, frame: wire.Frame | wire.BadFrame, ts: float) -> None:
        member = self.c.roster.of(conn)
        if isinstance(frame, wire.BadFrame):
            # the sender's problem: it hears why, the coordinator carries on
            send(conn, frame.error())
        elif self.c.nodes is not None and self.c.nodes.heard(conn, frame):
            pass  # a node agent's: the launcher's business
        elif member is None:
            send(conn, self._request(conn, frame))
        else:
            self._on_member_frame(member, frame, ts)
        self.c.changes.notify()

    def _request(self, conn: socket.socket, frame: wire.Frame) -> wire.Frame:
        """A frame from a connection that is not (yet) a member: a hello or an operator's
        request."""
        if isinstance(frame, wire.Hello):
            m = self.c.roster.admit(conn, frame)
            if m is None:
                return wire.Reject(
                    reason=f"{frame.agent_id} is not a process of this job (or fenced)"
                )
            # it started (a refilled spare) as the job ended: it leaves at once
            if self.c.state in ENDED:
                send(conn, wire.Welcome())
                code = 0 if self.c.state is JobState.FINISHED else 1
                return wire.Exit(code=code, reason="the job has ended")
            return wire.Welcome()
        if isinstance(frame, wire.NodeHello):
            c = self.c
            return admit_node(c.nodes, c.roster, conn, frame, lambda: c.spawn(Role.SPARE, -1))
        return operator_request(self.c, self.c.injector, frame)

    def _on_member_frame(self, m: Member, frame: wire.Frame, ts: float) -> None:
        if isinstance(frame, wire.Step):  # measured before the member's own view moves on
            self.c.progress.entered(m.slot, frame.k, m.completed)
        m.observe(frame, self.c.clock.monotonic(), ts)
        match frame:
            case wire.Step(k=k, digest=digest):
                self.c.injector.on_step(m)
                self.c.replicas.reported(m.slot, k, digest)
            case wire.Ready(layout=layout) | wire.Joined(layout=layout):
                self.c.roster.record_layout(m, layout)
                if m.role is Role.SPARE:
                    self.c.spares.started(m)
            case wire.Frozen(completed=step):
                self.c.progress.completed(step)
            case wire.Carries(what=what) if m.slot >= 0 and m.slot not in self.c.roster.carries:
                self.c.roster.carries[m.slot] = what
                log.warning(
                    "%s; no replica holds it, so a migration that replaces this rank's process "
                    "will be recorded as not live: declare it with agent.carry(...)",
                    what,
                )
            case wire.Done(step=step):
                self.c.progress.completed(step)
                if self.c.roster.finished(self.c.world_size):
                    self.c.fail(None, JobState.FINISHED)
            case wire.CheckpointSaved(step=step, path=path):
                self.c.checkpoints.saved(m, step, path, self.c.world_size)
            case wire.UserError(step=step, traceback=tb):
                self.c.fail(user_error(m.slot, step, tb), state=JobState.USER_ERROR)
            case _ if isinstance(frame, _NOT_FROM_MEMBERS):
                why = f"a member does not send {frame.t!r}"
                m.send(wire.Error(code=ErrorType.UNKNOWN_FRAME, reason=why))

    def on_close(self, conn: socket.socket, reason: str, ts: float) -> None:
        if self.c.nodes is not None and (node := self.c.nodes.closed(conn, self.c.changes.notify)):
            # A node lost whole: one report for the node, beside its ranks' own (all one incident).
            if self.c.state is JobState.TRAINING and (
                ev := self.c.detector.node_lost(node.name, ts, self.c.world_size, node.lost_why)
            ):
                self.c.add_evidence(ev)
            return
        m = self.c.roster.closed(conn)
        if (
            m is None
            or not m.alive
            or (m.state is MemberState.DONE and self.c.state is JobState.FINISHED)
        ):
            return
        task = asyncio.ensure_future(self._lost(m, ts, reason))
        self.c.tasks.add(task)
        task.add_done_callback(self.c.tasks.discard)
        self.c.changes.notify()

    async def _lost(self, m: Member, observed: float, reason: str) -> None:
        """A member's connection closed: find out whether its process died, then report it."""
        for _ in range(20):  # the exit status follows the closed socket within milliseconds
            if self.c.launcher.poll(m.agent_id) is not None:
                break
            await asyncio.sleep(0.005)
        code = self.c.launcher.poll(m.agent_id)
        warm, m.state = m.state is not MemberState.CONNECTED, MemberState.LOST
        self.c.changes.notify()
        if (
            self.c.launching
            and self.c.state is JobState.STARTING
            and m.role is Role.RANK
            and not m.fenced
        ):
            # Nothing to migrate yet, and most likely the script's own failure: say so now, not at
            # the start-up timeout.
            why = "unknown" if code is None else signal_name(code)
            self.c.fail(
                f"rank {m.slot} exited ({why}) before the job started training; see its output "
                "above"
            )
        if m.fenced or self.c.state not in (JobState.STARTING, JobState.TRAINING):
            return
        if m.role is Role.SPARE:  # a spare died: refill the pool, nothing to migrate
            self.c.spares.lost(m, warm)
        elif self.c.state is JobState.TRAINING:
            self.c.add_evidence(self.c.detector.lost(m, code, reason, observed))


def operator_request(c: Job, injector: Injector, frame: wire.Frame) -> wire.Frame:
    """An operator's or a cluster detector's request: inject, drain, a node's event, the job's
    status."""
    if isinstance(frame, wire.Inject):
        return injector.inject(frame)
    if isinstance(frame, wire.StatusRequest):
        return job_status(c)
    if isinstance(frame, wire.Drain):
        reply, ev = injector.drain(frame, c.state)
    elif isinstance(frame, wire.NodeEvent):
        reply, ev = c.cluster.heard(frame, c.state)
    else:
        return wire.Error(code=ErrorType.UNKNOWN_FRAME, reason=f"unexpected request {frame.t!r}")
    if ev is not None:
        c.add_evidence(ev)
    return reply


def job_status(c: Job) -> wire.Status:
    """The job's state, its ranks' steps, its warm spares and its incidents (`torchpass status`)."""
    inc = c.incidents.current
    return wire.Status(
        job_id=c.job_id,
        state=c.state,
        generation=c.generation,
        world_size=c.world_size,
        ranks=tuple(m.status() for m in c.roster.ranks()),
        spares=len(c.spares.ready()),
        incident=inc.workflow_id if inc else None,
        incidents=len(c.incidents.outcomes),
        nodes=tuple(n.name for n in c.nodes.joined()) if c.nodes is not None else (),
        idle_nodes=_idle_nodes(c),
    )


def _idle_nodes(c: Job) -> tuple[str, ...]:
    """Joined nodes running no rank where new ranks may go (not cordoned, drained or lost)."""
    if c.nodes is None:
        return ()
    busy = {m.node for m in c.roster.ranks()}
    return tuple(
        n.name for n in c.nodes.joined() if n.name not in busy and n.name not in c.nodes.avoid
    )
