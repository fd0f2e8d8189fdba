"""A rank process as its coordinator drives it: its connection, its process group generation by
generation, the commands it obeys (freeze, serve or receive the state, take a slot, form the next
group, exit), and what it tells a coordinator it rejoins. `RankAgent` (`agent.py`) adds what a
training script calls."""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from datetime import timedelta

import torch

from job_agent import wire
from job_agent.rank import loop
from job_agent.rank.ddp import Wrappers, placeholder_group
from job_agent.rank.fsdp import Sharded
from job_agent.rank.group import JobGroup, same_start
from job_agent.rank.inputs import InputWatch
from job_agent.rank.link import CoordinatorLink, exit_now
from job_agent.rank.rngs import GlobalDraws
from job_agent.rank.settings import AgentSettings
from job_agent.rank.sever import GroupSockets
from job_agent.rank.state import TrackedState
from job_agent.rank.store import RendezvousStore
from job_agent.rank.tensors import (
    environment,
    pick_device,
)
from job_agent.transfer.orders import receive, serve


class RecoveryTimeout(Exception):
    """The coordinator gave no instruction within recovery_timeout while this rank was frozen."""


class CoordinatedRank:
    """The coordinator-facing half of a rank agent (rank or warm spare)."""

    def __init__(self, settings: AgentSettings | None = None) -> None:
        self.settings = s = settings or AgentSettings.model_validate({})
        if threading.current_thread() is threading.main_thread():
            # A terminal's Ctrl-C reaches every process of its group: the coordinator stops the job
            # in order (it tells each rank to exit); a rank that died of it would be a failure to
            # migrate.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        torch.set_num_threads(s.threads)
        self.slot = s.slot
        self.world_size = s.world_size
        self.device = pick_device(s.device, s.local_rank)
        self.completed_step = -1
        self.generation = -1
        self._secret = s.read_secret()
        self._tracked: TrackedState | None = None
        self._inputs: InputWatch | None = None
        # A framework that saves and restores its own checkpoints (`job_agent.frameworks`): the
        # agent's restart loads none of its own.
        self.checkpoints_by_framework = False
        self._grad_buckets: list[list[torch.Tensor]] | None = None
        self._coll_timeout = timedelta(seconds=s.collective_timeout)
        self._recovery_timeout = timedelta(seconds=s.recovery_timeout)
        host, port = s.store_addr
        store = RendezvousStore(host, port, self._secret, self._recovery_timeout)
        self._environment = environment(self.device)
        hello = s.hello(wire.Role(s.role), s.slot, self._environment)
        self._link = CoordinatorLink(
            *s.coordinator_addr,
            self._secret,
            hello,
            timedelta(seconds=s.heartbeat_interval),
            rejoin_for=timedelta(seconds=s.rejoin_for),
        )
        self._link.rejoin_frames = self._standing
        self._steps: int | None = None
        self._frozen = False
        self._done: wire.Done | None = None
        self._group_sockets = GroupSockets()
        self._group_sockets.watch_new_groups()  # a script's own sub-groups are cut by a freeze too
        self._group = JobGroup(store, self.device, self._coll_timeout, self._group_sockets)
        self._link.on_abort = lambda: self._group_sockets.abort(nccl=self.device.type == "cuda")
        self._wrappers: Wrappers | None = None
        self._sharded: Sharded | None = None
        self._at = -1  # the last step this rank said it reached the collective in
        # the step whose entry reports this rank's state digest (after a recovery)
        self._verify_at = -1
        self._draws: GlobalDraws | None = None
        placeholder_group(self.slot, self.world_size)  # `DDP(model)` before the job's group forms

    @property
    def rank(self) -> int:
        return self.slot

    @property
    def is_spare(self) -> bool:
        return self.slot < 0

    def _freeze(self, in_flight: int | None, reason: str) -> None:
        # Outside the except block, so no traceback keeps the old group's sockets alive (which would
        # leave peers blocked until the group timeout).
        self._group.drop()
        if in_flight is not None:  # the step is done again from where it began
            assert self._tracked is not None and self._sharded is not None
            # its update is applied: done again, it would be applied twice
            if self._tracked.stepped:
                raise loop.step_applied(in_flight, reason, self._send)
            self._tracked.buffers.restore()
            self._sharded.reset()
        self._frozen = True
        self._send(
            wire.Frozen(completed=self.completed_step, in_flight=in_flight, reason=reason[:4000])
        )
        self._obey_until_regrouped()
        self._frozen = False

    def _check_inbox(self) -> None:
        if self._link.inbox.empty():
            return
        frame = self._link.inbox.get()
        if isinstance(frame, wire.Freeze):  # planned migration: stop at this step boundary
            # A peer already inside the next step's collective must see it fail now. Destroying the
            # group is not enough where the model still holds it (FSDP2's mesh): its sockets would
            # stay open and that peer would wait out the collective timeout (found on a drained
            # FSDP2 job).
            self._group_sockets.abort(nccl=self.device.type == "cuda")
            self._freeze(None, "freeze requested")
        else:
            self._handle(frame)

    def _obey_until_regrouped(self) -> None:
        # A spare waits for a slot as long as its job runs (the loss of its coordinator ends it); a
        # rank, or a spare once given a slot, hears what to do within the recovery timeout.
        limit = self._recovery_timeout.total_seconds()
        deadline = None if self.is_spare else time.monotonic() + limit
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                frame = self._link.inbox.get(timeout=wait)
            except queue.Empty:
                raise RecoveryTimeout(
                    f"no instruction from the coordinator for {limit:.0f} s"
                ) from None
            if self._handle(frame):
                return
            if deadline is None and not self.is_spare:
                deadline = time.monotonic() + limit

    def _handle(self, frame: wire.Frame) -> bool:
        """Carry out one coordinator command; True once the group is re-formed."""
        match frame:
            case wire.Freeze():
                self._send(wire.Frozen(completed=self.completed_step, reason="freeze"))
            case wire.Assign(slot=slot):
                self.slot = slot
                os.environ["RANK"] = os.environ["ROLE_RANK"] = str(slot)  # torchrun's names
            case wire.Serve():
                assert self._tracked is not None
                host, stop = self.settings.advertise_host, lambda: not self._link.inbox.empty()
                serve(
                    self._tracked, self._secret, host, self.completed_step, frame, self._send, stop
                )
            case wire.Receive():
                assert self._tracked is not None
                step = receive(self._tracked, self._secret, frame, self._send)
                self.completed_step = self.completed_step if step is None else step
            case wire.Regroup(generation=generation, world_size=world_size):
                return self._regroup(generation, world_size)
            case wire.Stop():
                self._stop()
            case wire.Exit(code=code, reason=reason):
                exit_now(code, reason)
        return False

    def _stop(self) -> None:
        """The job is stopped (Ctrl-C, SIGTERM) while this rank is frozen at a step boundary: it
        says what it holds, then goes (the script's code after the loop is for a finished job)."""
        assert self._tracked is not None
        digest = self._tracked.snapshot(self.completed_step).digest()
        self._send(wire.Done(step=self.completed_step, digest=digest))
        self._link.finished.set()
        self._link.close()
        exit_now(0, "")

    def _regroup(self, generation: int, world_size: int) -> bool:
        """Form generation `generation`'s group; False when it never forms (a peer was lost as it
        formed and the coordinator abandoned it): this rank stays frozen and waits for the next
        instruction."""
        self.generation = generation
        self.world_size = world_size

        def on_the_new_group() -> None:
            if self._sharded is not None:
                self._sharded.regroup()
            if self._wrappers is not None:
                self._wrappers.regroup(first=generation == 0)
            if generation == 0:
                assert self._tracked is not None and self._wrappers is not None
                same_start(self._tracked, self._wrappers, self._send)

        reason = self._group.form(generation, self.slot, world_size, on_the_new_group)
        if reason:
            self._send(wire.Frozen(completed=self.completed_step, reason=reason[:4000]))
            return False
        assert self._tracked is not None
        layout = self._tracked.layout()
        # once the redone step is done
        self._verify_at = self.completed_step + 2 if generation else -1
        self._send(wire.Joined(generation=generation, completed=self.completed_step, layout=layout))
        return True

    def _finish(self) -> None:
        assert self._tracked is not None
        digest = self._tracked.snapshot(self.completed_step).digest()
        self._done = wire.Done(step=self.completed_step, digest=digest)
        self._send(self._done)
        # Wait for the coordinator's word: leaving before every peer has finished the last
        # collective could break theirs.
        while not isinstance(
            self._link.inbox.get(timeout=self._recovery_timeout.total_seconds()), wire.Exit
        ):
            pass
        self._link.finished.set()
        self._group.drop()
        self._link.close()

    def _send(self, frame: wire.Frame) -> None:
        self._link.send(frame)

    def _standing(self) -> list[wire.Frame]:
        """What this process is, said to a restarted coordinator it rejoins: its hello, then the
        frames that put it where it stands (ready, or in its generation: training, frozen or
        done)."""
        role = wire.Role.SPARE if self.is_spare else wire.Role.RANK
        s, c = self.settings, self.completed_step
        hello = s.hello(role, self.slot, self._environment, rejoin=True)
        layout = self._tracked.layout() if self._tracked is not None else None
        # before its Ready (model still building): the hello
        if self.is_spare or self.generation < 0:
            ready = (
                []
                if self._steps is None
                else [wire.Ready(completed=c, steps=self._steps, layout=layout)]
            )
            return [hello, *ready]
        then = (
            [self._done]
            if self._done
            else [wire.Frozen(completed=c, reason="rejoined")] * self._frozen
        )
        return [hello, wire.Joined(generation=self.generation, completed=c, layout=layout), *then]
