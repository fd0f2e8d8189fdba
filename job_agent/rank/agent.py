"""The rank agent: adopted by a training script in a few lines, it makes each step survivable.

    agent = RankAgent()
    model, opt = build()
    agent.track(model, opt)
    agent.run(train_step, steps=1000)   # train_step(step) calls agent.all_reduce_gradients()

Inside `run` the agent reports step progress, seeds per-step randomness from (seed, step, rank) so nothing
rank-private ever has to move, and turns a failed collective into a freeze: it drops the broken process
group, reports the last completed step and obeys the coordinator (serve or receive state, re-form the
group for the next generation). The step that was in flight is then redone, so the job's state is bit for
bit the one of a run that never failed. A spare runs the same script: it builds the model, warms the
optimizer and waits in `run` until it is given a slot.
"""

from __future__ import annotations

import gc
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from job_agent import wire
from job_agent.rank import loop
from job_agent.rank.ddp import Wrappers, placeholder_group
from job_agent.rank.fsdp import Sharded
from job_agent.rank.group import JobGroup, same_start
from job_agent.rank.link import CoordinatorLink, exit_now
from job_agent.rank.loop import CollectiveFailure, Step, step_failure
from job_agent.rank.rngs import GlobalDraws, as_stateful, seed_globals
from job_agent.rank.settings import AgentSettings
from job_agent.rank.sever import GroupSockets
from job_agent.rank.state import TrackedState, shard_file
from job_agent.rank.store import RendezvousStore
from job_agent.rank.tensors import (
    GRAD_BUCKET_BYTES,
    bucketize,
    environment,
    pick_device,
    step_seed,
)
from job_agent.transfer.orders import receive, serve


class RecoveryTimeout(Exception):
    """The coordinator gave no instruction within recovery_timeout while this rank was frozen."""


class RankAgent:
    """One per training process (rank or warm spare); talks to the job's coordinator."""

    def __init__(self, settings: AgentSettings | None = None) -> None:
        self.settings = s = settings or AgentSettings.model_validate({})
        if threading.current_thread() is threading.main_thread():
            # A terminal's Ctrl-C reaches every process of its group: the coordinator stops the job in
            # order (it tells each rank to exit); a rank that died of it would be a failure to migrate.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        torch.set_num_threads(s.threads)
        self.slot = s.slot
        self.world_size = s.world_size
        self.device = pick_device(s.device, s.local_rank)
        self.completed_step = -1
        self.generation = -1
        self._secret = s.read_secret()
        self._tracked: TrackedState | None = None
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
        self._group = JobGroup(store, self.device, self._coll_timeout, self._group_sockets)
        self._link.on_abort = lambda: self._group_sockets.abort(nccl=self.device.type == "cuda")
        self._wrappers: Wrappers | None = None
        self._sharded: Sharded | None = None
        self._at = -1  # the last step this rank said it reached the collective in
        self._verify_at = -1  # the step whose entry reports this rank's state digest (after a recovery)
        self._draws: GlobalDraws | None = None
        placeholder_group(self.slot, self.world_size)  # `DDP(model)` before the job's group forms

    @property
    def rank(self) -> int:
        return self.slot

    @property
    def is_spare(self) -> bool:
        return self.slot < 0

    # --- adoption API ------------------------------------------------------------------------------

    def track(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, **extras: Any
    ) -> None:
        """Register the state that must survive a migration (model, optimizer, scheduler, scaler, the
        script's own random streams...)."""
        try:
            held = {name: as_stateful(name, obj) for name, obj in extras.items()}
        except TypeError as e:
            step_failure(-1, e, self._send)
            raise
        self._tracked = TrackedState(model, optimizer, held)
        self._grad_buckets = None
        try:
            self._wrappers = Wrappers(model, self._at_collective, optimizer)
            self._sharded = Sharded(model, self._at_collective)
        except ValueError as e:  # what will not replay: the job's result names it, not only the log
            step_failure(-1, e, self._send)
            raise
        # Everything alive now (torch's modules, the model) lives as long as the process: moving it out
        # of the collector's view makes the collection at each freeze take microseconds instead of
        # ~150 ms.
        gc.collect()
        gc.freeze()
        if self.is_spare:
            self._tracked.warm()  # touch the memory now, receive into it in place later
        elif self.settings.restore is not None:  # a sharded job's ranks each restore their own shard
            sharded = bool(self._sharded.modules)
            if sharded:  # its optimizer's state made now, as the DTensors the checkpoint's shards go into
                self._tracked.warm()
            restore = shard_file(self.settings.restore, self.slot * sharded)
            self.completed_step = self._tracked.load_checkpoint(restore)
        self._draws = GlobalDraws()  # a draw from here to the first step is data drawn outside a step

    def all_reduce_gradients(self) -> None:
        """Average gradients over the data-parallel group, in a fixed order (bitwise reproducible)."""
        self._at_collective()
        for bucket in self._buckets():
            flat = torch._utils._flatten_dense_tensors([p.grad for p in bucket])
            self.all_reduce(flat)
            flat.div_(self.world_size)
            for p, g in zip(
                bucket, torch._utils._unflatten_dense_tensors(flat, [p.grad for p in bucket]), strict=True
            ):
                assert p.grad is not None
                p.grad.copy_(g)

    def _at_collective(self) -> None:
        if self._at != (k := self.completed_step + 1):
            self._at = k
            self._send(wire.Collective(k=k))

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum in place over all ranks, with a real per-collective timeout; raises CollectiveFailure."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]
        opts.timeout = self._coll_timeout
        try:
            dist.distributed_c10d._get_default_group().allreduce([tensor], opts).wait()
        except RuntimeError as e:
            raise CollectiveFailure(str(e)) from None
        return tensor

    def run(self, train_step: Callable[[int], object], steps: int) -> None:
        """Run steps completed_step+1 .. steps-1, surviving failures of this rank's peers."""
        self._begin(steps)
        while (step := self.completed_step + 1) < steps:
            self._check_inbox()
            self._enter_step(step)
            failure = None
            try:
                train_step(step)
                self._after_step()
            except BaseException as e:
                failure = step_failure(step, e, self._send)
                if failure is None:
                    raise
            if failure is not None:  # outside the except block: see `_freeze`
                self._freeze(step, failure)
                continue
            self._complete_step(step)
        self._finish()

    def steps(self, total: int, data: Iterable[Any] | None = None) -> Iterator[Step]:
        """The loop form of `run`: `for step in agent.steps(total, data=loader): with step: ...`, each
        step's number `step.k` and batch `step.batch` (`job_agent.rank.loop` says how batches are drawn)."""
        return loop.steps(self, total, data)

    def busy(self, what: str) -> loop.Busy:
        """`with agent.busy("eval"):` around work only some ranks do while the others wait (not a hang)."""
        return loop.Busy(self._send, what)

    # --- the step and its failure modes ------------------------------------------------------------

    def _begin(self, steps: int) -> None:
        if self._tracked is None:
            raise RuntimeError("call agent.track(model, optimizer) before the training loop")
        loop.refuse_draws(self._draws, self._send)
        self._steps = steps
        self._send(wire.Ready(completed=self.completed_step, steps=steps, layout=self._tracked.layout()))
        self._obey_until_regrouped()

    def _enter_step(self, step: int) -> None:
        assert self._tracked is not None and self._wrappers is not None
        every = self.settings.verify_every
        check = step > 0 and (step == self._verify_at or (bool(every) and step % every == 0))
        self._send(wire.Step(k=step, digest=self._tracked.snapshot(step - 1).digest() if check else None))
        self._at = -1
        self._tracked.begin_step()
        self._wrappers.begin_step()
        seed_globals(step_seed(self.settings.seed, step, self.slot))

    def _after_step(self) -> None:
        assert self._wrappers is not None
        self._wrappers.after_step()

    def _complete_step(self, step: int) -> None:
        self.completed_step = step
        self._maybe_checkpoint(step)

    def _freeze(self, in_flight: int | None, reason: str) -> None:
        # Outside the except block, so no traceback keeps the old group's sockets alive (which would
        # leave peers blocked until the group timeout).
        self._group.drop()
        if in_flight is not None:  # the step is done again from where it began
            assert self._tracked is not None and self._sharded is not None
            if self._tracked.stepped:  # its update is applied: done again, it would be applied twice
                raise loop.step_applied(in_flight, reason, self._send)
            self._tracked.buffers.restore()
            self._sharded.reset()
        self._frozen = True
        self._send(wire.Frozen(completed=self.completed_step, in_flight=in_flight, reason=reason[:4000]))
        self._obey_until_regrouped()
        self._frozen = False

    def _check_inbox(self) -> None:
        if self._link.inbox.empty():
            return
        frame = self._link.inbox.get()
        if isinstance(frame, wire.Freeze):  # planned migration: stop at this step boundary
            # A peer already inside the next step's collective must see it fail now. Destroying the group
            # is not enough where the model still holds it (FSDP2's mesh): its sockets would stay open
            # and that peer would wait out the collective timeout (found on a drained FSDP2 job).
            self._group_sockets.abort(nccl=self.device.type == "cuda")
            self._freeze(None, "freeze requested")
        else:
            self._handle(frame)

    def _obey_until_regrouped(self) -> None:
        # A spare waits for a slot as long as its job runs (the loss of its coordinator ends it); a rank,
        # or a spare once given a slot, hears what to do within the recovery timeout.
        limit = self._recovery_timeout.total_seconds()
        deadline = None if self.is_spare else time.monotonic() + limit
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                frame = self._link.inbox.get(timeout=wait)
            except queue.Empty:
                raise RecoveryTimeout(f"no instruction from the coordinator for {limit:.0f} s") from None
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
            case wire.Serve():
                assert self._tracked is not None
                host, stop = self.settings.advertise_host, lambda: not self._link.inbox.empty()
                serve(self._tracked, self._secret, host, self.completed_step, frame, self._send, stop)
            case wire.Receive():
                assert self._tracked is not None
                step = receive(self._tracked, self._secret, frame, self._send)
                self.completed_step = self.completed_step if step is None else step
            case wire.Regroup(generation=generation, world_size=world_size):
                return self._regroup(generation, world_size)
            case wire.Exit(code=code, reason=reason):
                exit_now(code, reason)
        return False

    # --- recovery actions ----------------------------------------------------------------------------

    def _regroup(self, generation: int, world_size: int) -> bool:
        """Form generation `generation`'s group; False when it never forms (a peer was lost as it formed
        and the coordinator abandoned it): this rank stays frozen and waits for the next instruction."""
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
        self._verify_at = self.completed_step + 2 if generation else -1  # once the redone step is done
        self._send(wire.Joined(generation=generation, completed=self.completed_step, layout=layout))
        return True

    def _maybe_checkpoint(self, step: int) -> None:
        s, every = self.settings, self.settings.checkpoint_every
        sharded = self._sharded is not None and bool(self._sharded.modules)  # each rank saves its shard
        if (self.slot == 0 or sharded) and every and s.checkpoint_dir and (step + 1) % every == 0:
            assert self._tracked is not None
            path = self._tracked.save_rotated(s.checkpoint_dir, step, s.keep_checkpoints, self.slot)
            self._send(wire.CheckpointSaved(step=step, path=str(path)))

    def _finish(self) -> None:
        assert self._tracked is not None
        digest = self._tracked.snapshot(self.completed_step).digest()
        self._done = wire.Done(step=self.completed_step, digest=digest)
        self._send(self._done)
        # Wait for the coordinator's word: leaving before every peer has finished the last collective
        # could break theirs.
        while not isinstance(self._link.inbox.get(timeout=self._recovery_timeout.total_seconds()), wire.Exit):
            pass
        self._link.finished.set()
        self._group.drop()
        self._link.close()

    def _buckets(self) -> list[list[torch.Tensor]]:
        if self._grad_buckets is None:
            assert self._tracked is not None
            params = [p for p in self._tracked.model.parameters() if p.requires_grad]
            self._grad_buckets = bucketize(params, GRAD_BUCKET_BYTES)
        return [[p for p in b if p.grad is not None] for b in self._grad_buckets]

    def _send(self, frame: wire.Frame) -> None:
        self._link.send(frame)

    def _standing(self) -> list[wire.Frame]:
        """What this process is, said to a restarted coordinator it rejoins: its hello, then the frames
        that put it where it stands (ready, or in its generation: training, frozen or done)."""
        role = wire.Role.SPARE if self.is_spare else wire.Role.RANK
        s, c = self.settings, self.completed_step
        hello = s.hello(role, self.slot, self._environment, rejoin=True)
        layout = self._tracked.layout() if self._tracked is not None else None
        if self.is_spare or self.generation < 0:  # before its Ready (model still building): the hello
            ready = [] if self._steps is None else [wire.Ready(completed=c, steps=self._steps, layout=layout)]
            return [hello, *ready]
        then = [self._done] if self._done else [wire.Frozen(completed=c, reason="rejoined")] * self._frozen
        return [hello, wire.Joined(generation=self.generation, completed=c, layout=layout), *then]
