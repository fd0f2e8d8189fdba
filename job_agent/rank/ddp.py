"""Stock `DistributedDataParallel` under the agent: the wrapper the script built is moved onto each
new group, with a bucket layout that is the same on every rank and in every generation.

A script wraps its model as usual, `model = DDP(model, ...)`, before the job's group exists: the
agent gives the process a placeholder group at start-up (torch's "fake" backend: the job's rank and
world size, no communication) so the constructor runs, on a rank and on a spare alike. Once the
group forms, and after every re-formation, each tracked wrapper is moved onto it
(`DistributedDataParallel._update_process_group`) and:

- at the job's first formation, rank 0's parameters and buffers are broadcast to the others, which
  is what the constructor would have done on a real group (a script that leaves each rank's initial
  weights to chance still starts in step);
- its gradient buckets are rebuilt from the parameters' order (the layout a static graph gets) and
  never rebuilt again. DDP would otherwise lay buckets out by the order gradients became ready in
  the first backward after construction, so a spare's fresh wrapper would reduce with other buckets
  than its peers (the job aborts) and a survivor's first step after a recovery would sum in another
  order than an uninterrupted run (other bits).

The wrapper also tells the agent when the rank is about to reduce (after a forward that will be
followed by a synchronising backward): that is what tells a rank that hangs before its collective
from one that waits in it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.utils import _sync_module_states
from torch.nn.parallel import DistributedDataParallel

from job_agent.rank.fsdp import fsdp_modules

_BROADCAST_BUCKET = 250 * 1024 * 1024  # DDP's own broadcast bucket size


def placeholder_group(rank: int, world_size: int) -> None:
    """Make a default group of the job's shape that communicates nothing, unless there is one
    already."""
    if dist.is_initialized():
        return
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)

    dist.init_process_group(
        "fake", rank=max(rank, 0), world_size=world_size, store=dist.HashStore()
    )


class NotReplicas(ValueError):
    """Ranks meant to be replicas started from different states: the run could not be replayed."""


_FIX = {
    "model": "seed the model the same on every rank before building it (or wrap it in DDP, which "
    "starts every rank from rank 0's weights)",
    "random streams": "seed each random stream passed to track() the same on every rank: it is "
    "state the replicas share and a spare takes from one of them (for each rank's own randomness "
    "draw from torch's global RNG, which the agent seeds per step and rank)",
}


def check_same_start(shard: str, digest: str, what: str = "model") -> None:
    """Compare this rank's initial `what` with its replicas' (ranks holding the same shard), as the
    job's group first forms. A script that leaves each rank's initial weights to chance trains
    replicas that were never one state: no spare could stand in for one of them, and the run never
    replays."""
    mine = (shard, digest)
    every: list[tuple[str, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    odd = [r for r, other in enumerate(every) if other and other[0] == shard and other[1] != digest]
    if odd:
        raise NotReplicas(
            f"rank {dist.get_rank()} started from another {what} state than rank(s) {odd}, which "
            f"hold the same shard: {_FIX[what]}"
        )


def _stateful(state: object) -> bool:
    """A comm hook's state that holds what a re-formed group or a spare cannot take over. DDP's own
    mixed-precision hook state reads the wrapper's group when it runs: it follows the new one."""
    return state is not None and type(state).__name__ != "_AllreduceUpcastHookState"


def running_statistics(model: torch.nn.Module) -> list[str]:
    """The batch norms in `model` keeping running statistics of their own rank's batches, named."""
    return [
        f"{name or 'the model'} ({type(m).__name__})"
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
        and m.track_running_stats
        and m.training  # a frozen one (eval mode) keeps its statistics as they are
        # torch's, apex's: the ranks' statistics are one
        and "SyncBatchNorm" not in type(m).__name__
    ]


class Wrappers:
    """The `DistributedDataParallel` modules in a tracked model."""

    def __init__(
        self,
        model: torch.nn.Module,
        at_collective: Callable[[], None],
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        self.modules = [m for m in model.modules() if isinstance(m, DistributedDataParallel)]
        self._given = False  # this step's buffers already given, before the optimizer stepped
        if not self.modules and not fsdp_modules(model) and (stats := running_statistics(model)):
            raise ValueError(
                f"{stats[0]} keeps running statistics that each rank updates from its own batches, "
                "and no DDP wrapper gives every rank rank 0's: the replicas would differ and no "
                "spare could take a rank's over. Wrap the model in DistributedDataParallel "
                "(broadcast_buffers=True, the default), use SyncBatchNorm, or build it with "
                "track_running_stats=False"
            )
        for ddp in self.modules:
            if not ddp.broadcast_buffers and any(True for _ in ddp.module.buffers()):
                raise ValueError(
                    "DistributedDataParallel(broadcast_buffers=False) keeps each rank's buffers "
                    "(e.g. BatchNorm's running statistics) its own, so the replicas differ and a "
                    "spare could not take a lost rank's over: keep broadcast_buffers=True (the "
                    "default) or use SyncBatchNorm"
                )
            if any(_stateful(state) for _, state in getattr(ddp, "_comm_hooks", ())):
                raise ValueError(
                    "a DistributedDataParallel communication hook registered with a state "
                    "(PowerSGD's holds its process group and each rank's error feedback) cannot "
                    "follow the group re-formed after a failure nor move to a spare: register a "
                    "stateless hook (register_comm_hook(None, hook): allreduce, fp16 compression) "
                    "or none"
                )
            ddp.register_forward_hook(self._hook(ddp, at_collective))
        if optimizer is not None and self.modules:
            optimizer.register_step_pre_hook(self._before_optimizer)

    @staticmethod
    def _hook(
        ddp: DistributedDataParallel, at_collective: Callable[[], None]
    ) -> Callable[..., None]:
        def after_forward(*_: object) -> None:
            # not under no_sync, not eval
            if torch.is_grad_enabled() and ddp.require_backward_grad_sync:
                at_collective()

        return after_forward

    def begin_step(self) -> None:
        self._given = False

    def _before_optimizer(self, *_: object) -> None:
        """Rank 0's buffers, given before the tracked optimizer steps rather than as the step ends:
        a peer lost in this broadcast then fails the step before its update is applied, so that the
        step can be done again (after the update, it would be applied twice). The forward changed
        them: nothing after it in the step does."""
        if not self._given:
            self._sync_buffers()
            self._given = True

    def after_step(self) -> None:
        """Give every rank rank 0's buffers as a step ends (unless given already, before the
        optimizer stepped), as DDP does before each forward: the replicas are then one state at
        every step boundary (a spare taking over rank 0 gets rank 0's buffers)."""
        if not self._given:
            self._sync_buffers()

    def _sync_buffers(self) -> None:
        for ddp in self.modules:
            if ddp.will_sync_module_buffers():
                ddp._sync_buffers()

    def regroup(self, first: bool) -> None:
        """Move every wrapper onto the default group just formed (on every rank of it at once: the
        broadcasts are collectives). Raises RuntimeError when a peer is lost meanwhile."""
        group = dist.group.WORLD
        assert group is not None
        for ddp in self.modules:
            ddp._update_process_group(group)
            if first:
                _sync_module_states(
                    module=ddp.module,
                    process_group=group,
                    broadcast_bucket_size=_BROADCAST_BUCKET,
                    src=0,
                    params_and_buffers_to_ignore=ddp.parameters_to_ignore,
                    broadcast_buffers=True,
                )
            # All parameters, in their order, as the next layout; rebuilt now (it broadcasts rank
            # 0's layout) and marked as rebuilt, so the first backward does not lay the buckets out
            # again.
            ddp.reducer._push_all_rebuilt_params()
            ddp.reducer._rebuild_buckets()
            ddp._has_rebuilt_buckets = True
