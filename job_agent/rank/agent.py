"""The rank agent: adopted by a training script in a few lines, it makes each step survivable.

    agent = RankAgent()
    model, opt = build()
    agent.track(model, opt)
    agent.run(train_step, steps=1000)   # train_step(step) calls agent.all_reduce_gradients()

Inside `run` the agent reports step progress, seeds per-step randomness from (seed, step, rank) so
nothing rank-private ever has to move, and turns a failed collective into a freeze: it drops the
broken process group, reports the last completed step and obeys the coordinator (serve or receive
state, re-form the group for the next generation). The step that was in flight is then redone, so
the job's state is bit for bit the one of a run that never failed. A spare runs the same script: it
builds the model, warms the optimizer and waits in `run` until it is given a slot.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from job_agent import wire
from job_agent.rank import loop
from job_agent.rank.coordinated import CoordinatedRank
from job_agent.rank.ddp import Wrappers
from job_agent.rank.fsdp import Sharded
from job_agent.rank.inputs import InputWatch
from job_agent.rank.loop import CollectiveFailure, Step, step_failure
from job_agent.rank.rngs import GlobalDraws, as_stateful, seed_globals
from job_agent.rank.state import Carried, TrackedState, shard_file
from job_agent.rank.tensors import (
    GRAD_BUCKET_BYTES,
    bucketize,
    step_seed,
)


class RankAgent(CoordinatedRank):
    """One per training process (rank or warm spare); talks to the job's coordinator."""

    def track(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, **extras: Any
    ) -> None:
        """Register the state that must survive a migration (model, optimizer, scheduler, scaler,
        the script's own random streams...)."""
        try:
            held = {name: as_stateful(name, obj) for name, obj in extras.items()}
        except TypeError as e:
            step_failure(-1, e, self._send)
            raise
        self._tracked = TrackedState(model, optimizer, held)
        carried = self._tracked.buffers.carried
        self._inputs = InputWatch(model, self._send, lambda: [c.value for c in carried])
        self._grad_buckets = None
        try:
            self._wrappers = Wrappers(model, self._at_collective, optimizer)
            self._sharded = Sharded(model, self._at_collective)
        except ValueError as e:  # what will not replay: the job's result names it, not only the log
            step_failure(-1, e, self._send)
            raise
        # Everything alive now (torch's modules, the model) lives as long as the process: moving it
        # out of the collector's view makes the collection at each freeze take microseconds instead
        # of ~150 ms.
        gc.collect()
        gc.freeze()
        if self.is_spare:
            self._tracked.warm()  # touch the memory now, receive into it in place later
        # a sharded job's ranks each restore their own shard
        elif self.settings.restore is not None and not self.checkpoints_by_framework:
            sharded = bool(self._sharded.modules)
            # its optimizer's state made now, as the DTensors the checkpoint's shards go into
            if sharded:
                self._tracked.warm()
            restore = shard_file(self.settings.restore, self.slot * sharded)
            self.completed_step = self._tracked.load_checkpoint(restore)
        # a draw from here to the first step is data drawn outside a step
        self._draws = GlobalDraws()

    def carry(self, name: str, value: Any) -> Carried:
        """Declare state this rank carries from one step to the next and no other rank holds (an
        RNN's hidden state, a prefetched batch): read and set it as `.value` in the step. A step
        done again starts from its value as the step began; a migration that replaces this rank's
        process cannot bring it along, and its incident is recorded as not live, with why (the
        run then differs from one that never failed). Call it after `track`."""
        if self._tracked is None:
            raise RuntimeError("agent.carry(...) comes after agent.track(...)")
        if any(c.name == name for c in self._tracked.buffers.carried):
            raise ValueError(f"carried state {name!r} is declared twice")
        held = Carried(name, value)
        self._tracked.buffers.carried.append(held)
        return held

    def all_reduce_gradients(self) -> None:
        """Average gradients over the data-parallel group, in a fixed order (bitwise
        reproducible)."""
        self._at_collective()
        for bucket in self._buckets():
            flat = torch._utils._flatten_dense_tensors([p.grad for p in bucket])
            self.all_reduce(flat)
            flat.div_(self.world_size)
            for p, g in zip(
                bucket,
                torch._utils._unflatten_dense_tensors(flat, [p.grad for p in bucket]),
                strict=True,
            ):
                assert p.grad is not None
                p.grad.copy_(g)

    def _at_collective(self) -> None:
        if self._at != (k := self.completed_step + 1):
            self._at = k
            if self._inputs is not None:
                self._inputs.settle()
            self._send(wire.Collective(k=k))

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum in place over all ranks, with a real per-collective timeout; raises
        CollectiveFailure."""
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
        """The loop form of `run`: `for step in agent.steps(total, data=loader): with step: ...`,
        each step's number `step.k` and batch `step.batch` (`job_agent.rank.loop` says how batches
        are drawn)."""
        return loop.steps(self, total, data)

    def busy(self, what: str) -> loop.Busy:
        """`with agent.busy("eval"):` around work only some ranks do while the others wait (not a
        hang)."""
        return loop.Busy(self._send, what)

    def _begin(self, steps: int) -> None:
        if self._tracked is None:
            raise RuntimeError("call agent.track(model, optimizer) before the training loop")
        loop.refuse_draws(self._draws, self._send)
        self._steps = steps
        self._send(
            wire.Ready(completed=self.completed_step, steps=steps, layout=self._tracked.layout())
        )
        self._obey_until_regrouped()

    def _enter_step(self, step: int) -> None:
        assert self._tracked is not None and self._wrappers is not None
        every = self.settings.verify_every
        check = step > 0 and (step == self._verify_at or (bool(every) and step % every == 0))
        self._send(
            wire.Step(k=step, digest=self._tracked.snapshot(step - 1).digest() if check else None)
        )
        self._at = -1
        self._tracked.begin_step()
        self._wrappers.begin_step()
        if self._inputs is not None:
            self._inputs.begin(step, self.slot)
        seed_globals(step_seed(self.settings.seed, step, self.slot))

    def _after_step(self) -> None:
        assert self._wrappers is not None
        if self._inputs is not None:
            self._inputs.settle()
        self._wrappers.after_step()

    def _complete_step(self, step: int) -> None:
        self.completed_step = step
        self._maybe_checkpoint(step)

    def _maybe_checkpoint(self, step: int) -> None:
        if self.checkpoints_by_framework:
            return
        s, every = self.settings, self.settings.checkpoint_every
        # each rank saves its shard
        sharded = self._sharded is not None and bool(self._sharded.modules)
        if (self.slot == 0 or sharded) and every and s.checkpoint_dir and (step + 1) % every == 0:
            assert self._tracked is not None
            path = self._tracked.save_rotated(s.checkpoint_dir, step, s.keep_checkpoints, self.slot)
            self._send(wire.CheckpointSaved(step=step, path=str(path)))

    def _buckets(self) -> list[list[torch.Tensor]]:
        if self._grad_buckets is None:
            assert self._tracked is not None
            params = [p for p in self._tracked.model.parameters() if p.requires_grad]
            self._grad_buckets = bucketize(params, GRAD_BUCKET_BYTES)
        return [[p for p in b if p.grad is not None] for b in self._grad_buckets]
