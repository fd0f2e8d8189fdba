"""In-process fake ranks: a `Launcher` whose processes are threads (no torch, no subprocess).

A fake reads the TORCHPASS_* variables a real rank reads (the real `AgentSettings`), connects with
the real protocol and secret and sends what `job_agent.rank.agent.RankAgent` sends, in its order:
Hello, Ready (the same shard for every rank: data parallel), heartbeats; after each Regroup, Joined,
then per step Step(k), Collective(k) and a lockstep "all-reduce" with the other fakes of that
generation, which a peer killed or gone breaks: the survivors report Frozen(completed), as real
ranks leaving a failed collective do. Its state is a function of the step it completed
(`digest_of`): donor and receivers agree unless a fault says.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta

from job_agent import wire
from job_agent.launch.launcher import Launcher
from job_agent.rank.settings import AgentSettings
from job_agent.wire import protocol
from job_agent.wire.protocol import EXIT_COORDINATOR_LOST

SHARD = wire.ShardLayout(shard="fake-data-parallel-replica")
# What a real rank's torch says of a CPU host in its hello (`job_agent.rank.tensors.environment`).
ENVIRONMENT = wire.Environment(
    torch_version="2.13.0+cpu", backend="gloo", backend_available=True, cuda_available=False
)
STATE_BYTES = 1 << 20
KILLED, TERMINATED = -9, -15
_CONNECT = timedelta(seconds=5)


def digest_of(step: int) -> str:
    """The digest of a fake rank's whole state once it completed `step`."""
    return hashlib.sha256(f"state@{step}".encode()).hexdigest()


class _Gone(Exception):
    """The fake's process ends (its exit code is set by then, or stays None for a dropped one)."""


@dataclass(eq=False)
class _Group:
    """One generation of the world: collective number `seq` completes once every slot arrived at
    it."""

    size: int
    arrived: dict[int, set[int]] = field(default_factory=dict)
    broken: bool = False
    members: set[FakeRank] = field(default_factory=set)

    def status(self, seq: int) -> bool | None:  # True: done; False: broken before everyone came
        if len(self.arrived.get(seq, ())) >= self.size:
            return True
        return False if self.broken else None

    def wake(self) -> None:
        for m in self.members:
            m.wake()


class FakeRank:
    """One fake rank or spare; its thread is its process."""

    def __init__(self, launcher: FakeLauncher, agent_id: str, env: Mapping[str, str]) -> None:
        fields = {k[10:].lower(): v for k, v in env.items() if k.startswith("TORCHPASS_")}
        self.settings = AgentSettings.model_validate(
            {**fields, "heartbeat_interval": launcher.heartbeat}
        )
        assert self.settings.agent_id == agent_id
        self.agent_id, self.slot = agent_id, self.settings.slot
        self.code: int | None = None
        # the typed error frames the coordinator answered it with
        self.errors: list[wire.Error] = []
        self.completed = -1
        self._l = launcher
        self._sock: socket.socket | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)
        # its sockets: closed by the fake, hung up or woken by other threads
        self._io = threading.Lock()
        self._inbox: deque[wire.Frame] = deque()
        # running: not stopped (SIGSTOP)
        self.running, self._stop = threading.Event(), threading.Event()
        self.running.set()
        self._group: _Group | None = None
        self._seq, self._skip, self._next_beat = 0, 0, 0.0
        self.thread = threading.Thread(target=self._main, name=f"fake-rank-{agent_id}", daemon=True)

    def end(self, code: int | None) -> None:
        """The process ends with `code`; None: only its connection closes, the process lives on."""
        with self._l.lock:
            if code is not None:
                self.code = code if self.code is None else self.code
                self._stop.set()
                self.running.set()
            with self._io, contextlib.suppress(OSError):
                if self._sock is not None:
                    self._sock.shutdown(socket.SHUT_RDWR)
            self._leave()
        self.wake()

    def wake(self) -> None:
        with self._io, contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    def _leave(self) -> None:
        """Leave its generation (the caller holds the launcher's lock): a collective it was in
        fails."""
        g, self._group = self._group, None
        if g is not None:
            g.members.discard(self)
            g.broken = True
            g.wake()

    def _main(self) -> None:
        try:
            self._connect()
            self._train()
        except _Gone:
            pass
        except (OSError, ConnectionError, protocol.ProtocolError):
            # what a real rank's link does when it loses the coordinator
            self.end(EXIT_COORDINATOR_LOST)
        finally:
            self.end(TERMINATED)  # unless it ended with a code of its own: as if by SIGTERM
            with self._io:
                for s in (self._sock, self._wake_r, self._wake_w):
                    if s is not None:
                        s.close()

    def _connect(self) -> None:
        s = self.settings
        with self._l.lock:
            doomed = s.role == "spare" and self._l.doomed_spares > 0
            self._l.doomed_spares -= doomed
        if doomed:
            self.end(1)
            raise _Gone
        sock = protocol.connect(*s.coordinator_addr, s.read_secret(), _CONNECT)
        with self._io:
            self._sock = sock
        self._alive()
        hello = wire.Hello(
            agent_id=self.agent_id,
            role=wire.Role(s.role),
            slot=self.slot,
            pid=os.getpid(),
            environment=self._l.environments.get(self.slot, ENVIRONMENT),
        )
        protocol.send_frame(sock, hello)
        if not isinstance(protocol.recv_frame(sock), wire.Welcome):
            self.end(1)  # a real rank's script dies of the refusal
            raise _Gone
        with self._l.lock:
            crash = s.role == "spare" and self._l.spares_crashing > 0
            self._l.spares_crashing -= crash
        if crash:
            self.end(1)  # its script failed while it built the model, before it was warm
            raise _Gone

    def _train(self) -> None:
        steps = self._l.steps
        if self.settings.restore is not None:  # "step-00000007.fake": a checkpoint of step 7
            self.completed = int(self.settings.restore.stem.split("-")[1])
        self._send(wire.Ready(completed=self.completed, steps=steps, layout=self._layout()))
        self._obey_until_regrouped()
        while (step := self.completed + 1 + self._skip) < steps:
            self._skip = 0
            if self._check_inbox():
                continue
            self._faults(step)
            if self._l.step_seconds:
                # a step that takes time: the coordinator's clock moves on
                self._pump(self._l.step_seconds)
            self._send(wire.Step(k=step))
            self._send(wire.Collective(k=step))
            if not self._all_reduce():
                self._freeze(step, "collective failed: a peer is gone")
                continue
            self.completed = step
            s = self.settings
            if self.slot == 0 and s.checkpoint_every and (step + 1) % s.checkpoint_every == 0:
                path = f"{s.checkpoint_dir}/step-{step:08d}.fake"
                self._send(wire.CheckpointSaved(step=step, path=path))
        self._send(wire.Done(step=self.completed, digest=digest_of(self.completed)))
        # a finished rank waits for its word
        while not isinstance(frame := self._next_frame(), wire.Exit):
            pass
        self.end(frame.code)

    def _faults(self, step: int) -> None:
        """What the fault injector armed for this slot, as the rank enters `step`."""
        lc = self._l
        if lc.take("fail", self.slot, step):
            lc.kill(self.agent_id)
            raise _Gone
        if lc.take("hang", self.slot, step):
            lc.suspend(self.agent_id)
            self._alive()  # stopped here until resumed (or killed)
        if lc.take("drop", self.slot, step):
            self.end(None)  # out of the world and off the control channel, alive until killed
            self._stop.wait()  # launcher.shutdown ends every fake
            raise _Gone
        body = lc.malformed.pop((self.slot, step), None)
        if body is not None:
            assert self._sock is not None
            # well tagged: the peer holds the key, the body is bad
            protocol.send_body(self._sock, body)

    def _all_reduce(self) -> bool:
        self._seq += 1
        with self._l.lock:
            g = self._group
            if g is None:
                return False
            g.arrived.setdefault(self._seq, set()).add(self.slot)
            g.wake()
        deadline = time.monotonic() + self.settings.collective_timeout
        while True:
            with self._l.lock:
                done = g.status(self._seq)
                if done is None and time.monotonic() >= deadline:
                    g.broken = done = False  # a real collective times out
                    g.wake()
            if done is not None:
                return done
            self._pump(deadline - time.monotonic())

    def _freeze(self, in_flight: int | None, reason: str) -> None:
        with self._l.lock:
            self._leave()
        self._send(wire.Frozen(completed=self.completed, in_flight=in_flight, reason=reason))
        self._obey_until_regrouped()

    def _check_inbox(self) -> bool:
        """The commands that came during the step (a Freeze stops it at this boundary); True:
        regrouped."""
        self._pump(0)
        while self._inbox:
            if self._handle(self._inbox.popleft()):
                return True
        return False

    def _obey_until_regrouped(self) -> None:
        while not self._handle(self._next_frame()):
            pass

    def _handle(self, frame: wire.Frame) -> bool:
        """Carry out one coordinator command; True once this rank joined a new generation."""
        match frame:
            # training: it stops at this step boundary
            case wire.Freeze() if self._group is not None:
                self._freeze(None, "freeze requested")
                return True
            case wire.Freeze():
                self._send(wire.Frozen(completed=self.completed, reason="freeze"))
            case wire.Assign(slot=slot):
                self.slot = slot
            case wire.Serve(receivers=n, transfer=tid):
                self._serve(n, tid)
            case wire.Receive(sources=sources, transfer=tid):
                self._receive(sources[0].port, tid)
            case wire.Regroup(generation=generation, world_size=world_size):
                with self._l.lock:
                    self._leave()
                    self._group = g = self._l.groups.setdefault(generation, _Group(world_size))
                    g.members.add(self)
                self._seq = 0
                self._send(
                    wire.Joined(
                        generation=generation, completed=self.completed, layout=self._layout()
                    )
                )
                self._skip = self._l.resume_offset.pop(self.slot, 0)
                return True
            case wire.Exit(code=code):
                self.end(code)
                raise _Gone
        return False

    def _layout(self) -> wire.ShardLayout:
        """Data parallel (every rank one replica), or with `sharded` each slot a shard of its own
        (plain FSDP2: no replica)."""
        return wire.ShardLayout(shard=f"fake-shard-{self.slot}") if self._l.sharded else SHARD

    def _serve(self, receivers: int, tid: int) -> None:
        """Serve this rank's state on a made-up port: receivers read the step it holds from the
        launcher."""
        with self._l.lock:
            port = 40000 + len(self._l.offers)
            self._l.offers[port] = self.completed
        self._send(wire.Serving(host="127.0.0.1", port=port, step=self.completed, transfer=tid))
        self._send(wire.TransferProgress(bytes=STATE_BYTES * receivers))
        digest = digest_of(self.completed)
        self._send(
            wire.Served(
                digest=digest, step=self.completed, bytes=STATE_BYTES, seconds=0.001, transfer=tid
            )
        )

    def _receive(self, port: int, tid: int) -> None:
        with self._l.lock:
            step = self._l.offers.get(port)
        if step is None:
            self._send(wire.TransferFailed(error=f"nobody serves on port {port}", transfer=tid))
            return
        self.completed = step
        stream = installed = digest_of(step)
        # one character off: what a load that altered a byte shows
        if self._l.take("corrupt", self.slot):
            installed = ("0" if installed[0] != "0" else "1") + installed[1:]
        self._send(
            wire.Received(
                stream_digest=stream,
                installed_digest=installed,
                step=step,
                bytes=STATE_BYTES,
                seconds=0.001,
                transfer=tid,
            )
        )

    def _alive(self) -> None:
        """Returns while the process runs, blocks while it is stopped (a hang), _Gone once it
        ended."""
        while not self.running.wait(1.0) and not self._stop.is_set():
            pass
        if self._stop.is_set():
            raise _Gone

    def _send(self, frame: wire.Frame) -> None:
        self._alive()
        assert self._sock is not None
        protocol.send_frame(self._sock, frame)

    def _pump(self, timeout: float) -> None:
        """Up to `timeout` s (less once anything happens): heart-beat and queue the coordinator's
        frames."""
        end = time.monotonic() + max(0.0, timeout)
        while True:
            self._alive()
            assert self._sock is not None
            now = time.monotonic()
            if now >= self._next_beat:
                self._send(wire.Heartbeat())
                self._next_beat = now + self.settings.heartbeat_interval
            wait = max(0.0, min(end, self._next_beat) - now)
            ready, _, _ = select.select([self._sock, self._wake_r], [], [], wait)
            if self._wake_r in ready:
                with contextlib.suppress(BlockingIOError):
                    self._wake_r.recv(4096)
            if self._sock in ready:
                self._read()
            if ready or time.monotonic() >= end:
                self._alive()
                return

    def _read(self) -> None:
        assert self._sock is not None
        frame = protocol.recv_frame(self._sock)  # a killed fake's error ends it: its code stands
        if isinstance(frame, wire.Error):
            self.errors.append(frame)
        elif isinstance(frame, wire.Exit) and (frame.code != 0 or self.settings.role == "spare"):
            self.end(frame.code)  # obeyed at once, even in the middle of a collective
            raise _Gone
        else:
            self._inbox.append(frame)

    def _next_frame(self) -> wire.Frame:
        # As a real agent: an unassigned spare waits as long as the job runs; a rank within the
        # timeout.
        deadline = time.monotonic() + self._l.recovery_timeout
        while not self._inbox:
            if self.slot < 0:
                deadline = time.monotonic() + self._l.recovery_timeout
            if time.monotonic() >= deadline:
                self.end(1)  # a real rank raises RecoveryTimeout and its script dies
                raise _Gone
            self._pump(deadline - time.monotonic())
        return self._inbox.popleft()


class FakeLauncher(Launcher):
    """Fake ranks in threads, with a fault injector; `poll` reads the exit code a fake ended
    with."""

    def __init__(
        self, steps: int = 16, heartbeat: float = 0.1, recovery_timeout: float = 30.0
    ) -> None:
        self.steps, self.heartbeat, self.recovery_timeout = steps, heartbeat, recovery_timeout
        self.lock = threading.Lock()
        self.fakes: dict[str, FakeRank] = {}
        self.groups: dict[int, _Group] = {}
        self.offers: dict[int, int] = {}  # port -> the completed step its donor serves
        self.faults: set[tuple[str, int, int | None]] = set()
        self.resume_offset: dict[int, int] = {}
        self.malformed: dict[tuple[int, int], bytes] = {}
        self.doomed_spares = 0
        self.spares_crashing = 0
        self.step_seconds = 0.0
        self.sharded = False  # each slot its own shard, no replica (plain FSDP2)
        # slot -> what it says instead of ENVIRONMENT
        self.environments: dict[int, wire.Environment] = {}

    def fail_at(self, slot: int, step: int) -> None:
        """The rank holding `slot` dies (SIGKILL) as it enters `step`."""
        self.faults.add(("fail", slot, step))

    def hang_at(self, slot: int, step: int) -> None:
        """The rank holding `slot` stops as it enters `step`, as SIGSTOP would stop it."""
        self.faults.add(("hang", slot, step))

    def drop_connection_at(self, slot: int, step: int) -> None:
        """The rank holding `slot` loses its connection as it enters `step`; its process lives
        on."""
        self.faults.add(("drop", slot, step))

    def corrupt_receive(self, slot: int) -> None:
        """The next receiver at `slot` reports an installed digest one character off the donor's."""
        self.faults.add(("corrupt", slot, None))

    def resume_elsewhere(self, slot: int, offset: int) -> None:
        """After its next Regroup the rank at `slot` enters step completed + 1 + `offset`."""
        self.resume_offset[slot] = offset

    def spares_die_at_start(self, n: int) -> None:
        """The next `n` spares launched exit (code 1) before they connect, as a crash at import
        would."""
        self.doomed_spares = n

    def spares_crash_once_connected(self, n: int) -> None:
        """The next `n` spares launched connect, then exit (code 1) before they are warm, as a
        script that fails building its model (a `DistributedSampler` given the spare's rank -1)
        would."""
        self.spares_crashing = n

    def malformed_at(self, slot: int, step: int, body: bytes) -> None:
        """The rank at `slot` sends `body` as one frame as it enters `step`."""
        self.malformed[(slot, step)] = body

    # an armed fault fires once
    def take(self, kind: str, slot: int, step: int | None = None) -> bool:
        with self.lock:
            armed = (kind, slot, step) in self.faults
            self.faults.discard((kind, slot, step))
        return armed

    def threads(self) -> list[threading.Thread]:  # the fake ranks' threads still running
        return [f.thread for f in self.fakes.values() if f.thread.is_alive()]

    def spawn(self, agent_id: str, env: Mapping[str, str]) -> str:
        fake = self.fakes[agent_id] = FakeRank(self, agent_id, env)
        fake.thread.start()
        return f"fake-node-{agent_id}"

    def kill(self, agent_id: str) -> None:
        self.fakes[agent_id].end(KILLED)

    def suspend(self, agent_id: str) -> None:
        self.fakes[agent_id].running.clear()

    def resume(self, agent_id: str) -> None:
        self.fakes[agent_id].running.set()

    def poll(self, agent_id: str) -> int | None:
        return self.fakes[agent_id].code

    def pid(self, agent_id: str) -> int | None:
        return self.fakes[agent_id].thread.native_id

    def shutdown(self, timeout: timedelta) -> None:
        fakes = list(self.fakes.values())  # in a thread, as the loop may still spawn (a refill)
        for fake in fakes:
            fake.end(TERMINATED)  # one that exited keeps its code
        for fake in fakes:
            fake.thread.join(timeout.total_seconds())
