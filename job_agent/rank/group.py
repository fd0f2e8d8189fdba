"""A rank's process group for its job, one generation at a time.

Each generation's group forms on the job's own store under a prefix of its own (reusing one makes
`init_process_group` read stale keys), and is dropped completely before the next: destroyed, every
reference gone, garbage collected. A survivor that keeps the old group alive leaves its peers
blocked until the group timeout.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from job_agent import wire
from job_agent.rank.ddp import NotReplicas, Wrappers, check_same_start
from job_agent.rank.loop import step_failure
from job_agent.rank.sever import GroupSockets
from job_agent.rank.state import TrackedState
from job_agent.rank.store import RendezvousStore
from job_agent.wire.store import STORE_PREFIX


class JobGroup:
    """The job's process group as this rank holds it: formed per generation, dropped between
    them."""

    def __init__(
        self,
        store: RendezvousStore,
        device: torch.device,
        timeout: timedelta,
        sockets: GroupSockets,
    ) -> None:
        self._store = store
        self._backend = "nccl" if device.type == "cuda" else "gloo"
        self._timeout = timeout
        self._sockets = sockets

    def form(self, generation: int, slot: int, world_size: int, then: Callable[[], None]) -> str:
        """Form generation `generation`'s group as rank `slot` of `world_size`, then run `then` on
        it (the script's wrappers moved onto it). "" once formed, else why it did not (a peer was
        lost as it formed, and the coordinator abandoned the generation)."""
        self.drop()
        self._sockets.forming()
        try:
            dist.init_process_group(
                self._backend,
                store=dist.PrefixStore(f"{STORE_PREFIX}{generation}", self._store),
                rank=slot,
                world_size=world_size,
                timeout=self._timeout,
            )
            then()
        except (dist.DistStoreError, RuntimeError) as e:
            reason = f"generation {generation} did not form: {e}"
        else:
            self._sockets.formed()
            return ""
        # Outside the except block: no traceback keeps a half-made group alive. The failed init took
        # a group name from torch's counter (its keys live under `<n>/`) and only destroying a
        # formed world resets it: reset it as that does, or this rank's next group waits under `1/`
        # for peers writing `0/` (a fresh spare) until the store times out.
        c10d._world.group_count = 0
        gc.collect()
        return reason

    @staticmethod
    def drop() -> None:
        if not dist.is_initialized():
            return
        with contextlib.suppress(RuntimeError):  # a broken group may fail to shut down cleanly
            dist.destroy_process_group()
        # Reference cycles (failed work objects, their exceptions) can keep the old group's sockets
        # open, which leaves peers blocked until the group timeout.
        gc.collect()


def same_start(
    tracked: TrackedState, wrappers: Wrappers, send: Callable[[wire.Frame], None]
) -> None:
    """As the job's group first forms, replicas hold one model (unless DDP broadcasts it) and one
    position of each random stream the script tracks (a spare takes both from a replica)."""
    shard, extras = tracked.layout().shard, tracked.extras.items()
    streams = {k: v for k, v in extras if getattr(v, "rewound_each_step", False)}
    try:
        if not wrappers.modules:  # the model alone: an extra (a scheduler) may be the rank's own
            check_same_start(shard, TrackedState(tracked.model).snapshot(-1).digest())
        if streams:
            held = TrackedState(torch.nn.Module(), None, streams).snapshot(-1).digest()
            check_same_start(shard, held, what="random streams")
    except NotReplicas as e:  # the script's setup, named in the job's result
        step_failure(-1, e, send)
        raise
