"""The step loop in the form ordinary scripts are written in, and what both loop forms do with a
step's error.

    for step in agent.steps(1000, data=loader):  # the loop form (`agent.run(...)` is the other)
        with step:  # a failed collective in here: this step is done again
            x, y = step.batch
            ...

The agent owns the step boundary either way: it reports each step, seeds torch's RNG from (seed,
step, rank), and turns a collective failed by a peer's loss into a freeze, after which the same step
is handed out again with the same batch. Entering each step with `with` is what lets it catch that
failure; a step left without `with` is refused with that reason.

`data` (a `DataLoader`, or anything iterable again and again with a length) is read by step: step k
takes batch k % len(data) of epoch k // len(data). A `DistributedSampler` behind it is given this
rank and the epoch before each pass, and the pass's order is drawn from the RNG seeded by (seed,
epoch, rank) (the loader's and sampler's own generators too, where they have one), so a spare that
takes over a rank at step k reads exactly the batches the lost rank would have.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import torch
from torch.utils.data.distributed import DistributedSampler

from job_agent import wire
from job_agent.rank.rngs import GlobalDraws
from job_agent.rank.settings import AgentSettings
from job_agent.rank.tensors import step_seed

EXIT_DEVICE_ERROR = 75
_COLLECTIVE_MARKERS = (
    "gloo",
    "Connection closed by peer",
    "Connection reset by peer",
    "NCCL",
    "Broken pipe",
)
_DEVICE_MARKERS = ("CUDA error", "CUDA driver", "cudaError", "device-side assert")
_EPOCH_STREAM = 1 << 40  # epoch seeds are drawn apart from step seeds


class CollectiveFailure(Exception):
    """A collective failed because a peer died, hung or was fenced: a migration, not a bug."""


def step_failure(step: int, e: BaseException, send: Callable[[wire.Frame], None]) -> str | None:
    """What a step's exception means: why the step failed if a peer did (the step is done again);
    None for the script's own error, which has been reported and must propagate. A device error ends
    the process at once (its GPU is not to be trusted), reported as such."""
    if isinstance(e, CollectiveFailure):
        return str(e)
    if not isinstance(e, Exception):
        return None  # KeyboardInterrupt, SystemExit: not the agent's to handle
    msg = str(e)
    if isinstance(e, RuntimeError) and any(m in msg for m in _COLLECTIVE_MARKERS):
        return msg
    if isinstance(e, torch.OutOfMemoryError) or any(m in msg for m in _DEVICE_MARKERS):
        send(wire.DeviceError(detail=msg[:2000]))
        traceback.print_exception(e)
        os._exit(EXIT_DEVICE_ERROR)
    # The script's own bug: the user must see their traceback, and no migration starts.
    send(wire.UserError(step=step, traceback="".join(traceback.format_exception(e))[-4000:]))
    return None


def refuse_draws(draws: GlobalDraws | None, send: Callable[[wire.Frame], None]) -> None:
    """As training begins: a draw from a global stream after `track()` (data fetched ahead of the
    loop, as nanoGPT fetches its first batch) is one a spare taking a rank over would not draw the
    same, nor the batch the script fetches within a step for the next. Refused, naming the fix."""
    drawn = draws.drawn() if draws is not None else []
    if drawn:
        e = ValueError(
            f"the script drew from {' and '.join(drawn)}'s global random stream after "
            "agent.track() and before its first step: data drawn outside a step, or fetched in a "
            "step for the next, is not what a spare taking a rank over would draw. Draw each "
            "step's data inside that step (or pass data= to agent.steps), and build what needs "
            "randomness before agent.track()"
        )
        step_failure(-1, e, send)
        raise e


class StepApplied(RuntimeError):
    """A peer was lost in a collective that came after the optimizer's step: the step cannot be done
    again (its update would be applied twice) and the job cannot go on live."""


def step_applied(step: int, reason: str, send: Callable[[wire.Frame], None]) -> StepApplied:
    """The error a rank ends with when its step failed after its optimizer stepped, said to the
    coordinator as the script's (`UserError`): it is the script's shape that makes the step not
    redoable."""
    e = StepApplied(
        f"step {step} failed after optimizer.step() ({reason[:300]}): its update is applied, and "
        "doing the step again would apply it twice. A step's collectives must come before the "
        "optimizer's step: all-reduce a loss for logging after backward() and before "
        "optimizer.step(), or log each rank's own"
    )
    send(wire.UserError(step=step, traceback=str(e)))
    return e


class Step:
    """One step of the loop form: its number `k` and its `batch` (None without `data`). Enter it
    with `with step:`; a peer's failure inside ends the block quietly and the step comes round
    again."""

    def __init__(
        self,
        k: int,
        batch: Any,
        send: Callable[[wire.Frame], None],
        after: Callable[[], None] = lambda: None,
    ) -> None:
        self.k = k
        self.batch = batch
        self.failure: str | None = None
        self.entered = False
        self._send, self._after = send, after

    def __enter__(self) -> Step:
        self.entered = True
        return self

    def __exit__(self, kind: object, e: BaseException | None, tb: object) -> bool:
        if e is None:
            try:
                # the step's own end (a buffer broadcast): a peer's loss in it is the step's
                self._after()
            except Exception as after:
                e = after
            else:
                return False
        self.failure = step_failure(self.k, e, self._send)
        return self.failure is not None

    def __index__(self) -> int:  # `range(step)`, `lr[step]`: the step is its number
        return self.k

    def __repr__(self) -> str:
        return f"Step({self.k})"


class Busy:
    """`with agent.busy("eval"):` work some ranks do while the others wait for them at the next
    collective (rank-0-only evaluation, saving, logging): the coordinator takes such a rank for
    late, not hung. The peers' collective timeout (`--collective-timeout`) still bounds the wait."""

    def __init__(self, send: Callable[[wire.Frame], None], what: str) -> None:
        self._send, self._what = send, what[:200]

    def __enter__(self) -> None:
        self._send(wire.Busy(what=self._what, busy=True))

    def __exit__(self, *exc: object) -> None:
        self._send(wire.Busy(what=self._what, busy=False))


class Batches:
    """The batch of each step from re-iterable `data`, positioned by the step number alone."""

    def __init__(self, data: Iterable[Any], seed: int) -> None:
        self.data = data
        self.per_epoch = len(data)  # type: ignore[arg-type]
        if self.per_epoch < 1:
            raise ValueError("agent.steps(data=...): the data has no batches")
        if getattr(data, "persistent_workers", False) and getattr(data, "num_workers", 0) > 0:
            raise ValueError(
                "agent.steps(data=...): a DataLoader with persistent_workers=True keeps its worker "
                "processes, and their random streams, from one pass to the next, so a spare's new "
                "workers would draw other numbers than those of the rank it takes over: build it "
                "with persistent_workers=False (the agent seeds each pass's workers from the pass "
                "and the rank)"
            )
        self._seed = seed
        self._it: Iterator[Any] | None = None
        self._epoch = self._next = -1
        self._step, self._batch = -1, None

    def at(self, step: int, rank: int, world_size: int) -> Any:
        if step == self._step:  # the step done again: the same batch
            return self._batch
        epoch, index = divmod(step, self.per_epoch)
        if self._it is None or epoch != self._epoch or index != self._next:
            self._it = self._start(epoch, rank, world_size)
            for _ in range(index):  # a spare joining mid-epoch, or a step skipped: read up to it
                next(self._it)
            self._next = index
        self._step, self._batch = step, next(self._it)
        self._next += 1
        return self._batch

    def _start(self, epoch: int, rank: int, world_size: int) -> Iterator[Any]:
        seed = step_seed(self._seed, _EPOCH_STREAM + epoch, rank)
        sampler = getattr(self.data, "sampler", None)
        if isinstance(sampler, DistributedSampler):
            if sampler.num_replicas != world_size:
                raise ValueError(
                    f"the DistributedSampler has num_replicas={sampler.num_replicas} but the job "
                    f"has {world_size} ranks: build it with num_replicas=agent.world_size"
                )
            sampler.rank = rank
            sampler.set_epoch(epoch)
        for owner in (self.data, sampler):
            generator = getattr(owner, "generator", None)
            if isinstance(generator, torch.Generator):
                generator.manual_seed(seed)
        torch.manual_seed(seed)  # a sampler or loader drawing its order from the global RNG
        if isinstance(getattr(self.data, "_num_iter_calls", None), int):
            # Lightning Fabric's loader sets its sampler's epoch to the passes it has started: a
            # spare's, or a pass opened again, would count others than the epoch
            self.data._num_iter_calls = epoch  # type: ignore[attr-defined]
        self._epoch = epoch
        return iter(self.data)


class LoopAgent(Protocol):
    """What the loop needs of the rank agent (`RankAgent`)."""

    settings: AgentSettings
    completed_step: int
    world_size: int

    @property
    def rank(self) -> int: ...
    def _begin(self, steps: int) -> None: ...
    def _check_inbox(self) -> None: ...
    def _enter_step(self, step: int) -> None: ...
    def _after_step(self) -> None: ...
    def _complete_step(self, step: int) -> None: ...
    def _freeze(self, in_flight: int | None, reason: str) -> None: ...
    def _finish(self) -> None: ...
    def _send(self, frame: wire.Frame) -> None: ...


def steps(agent: LoopAgent, total: int, data: Iterable[Any] | None) -> Iterator[Step]:
    """The loop form of `RankAgent.run` (see the module's docstring)."""
    try:
        batches = None if data is None else Batches(data, agent.settings.seed)
    except ValueError as e:  # what will not replay: the job's result names it, not only the log
        step_failure(-1, e, agent._send)
        raise
    agent._begin(total)
    while (k := agent.completed_step + 1) < total:
        agent._check_inbox()
        batch = None if batches is None else batches.at(k, agent.rank, agent.world_size)
        agent._enter_step(k)
        step = Step(k, batch, agent._send, agent._after_step)
        try:
            yield step
        # `break`: the job ends here, after this step (every rank must break at it)
        except GeneratorExit:
            if step.entered and step.failure is None:
                agent._complete_step(k)
            agent._finish()
            raise
        if not step.entered:
            raise RuntimeError(
                f"step {k} was not entered: write the loop's body under `with step:`"
            )
        if step.failure is not None:
            # outside any except block: no traceback holds the old group
            agent._freeze(k, step.failure)
            continue
        agent._complete_step(k)
    agent._finish()
