"""Lightning's `Trainer`, migrated live: `LiveDDPStrategy` is Lightning's DDP strategy with the
agent's step boundary in the Trainer's own loop. One line in a script, after `RankAgent()`:

    agent = RankAgent()                                             # torchpass: first
    trainer = L.Trainer(accelerator="cpu", devices=agent.world_size, max_steps=...,
                        strategy=LiveDDPStrategy(agent))            # torchpass
    trainer.fit(model, datamodule=dm)

- **A step** is one optimizer update (one batch: gradient accumulation is refused for now). It
  begins at the batch's `on_train_batch_start` (the agent seeds torch's RNG per (seed, step, rank))
  and is complete at its `on_train_batch_end`, after the scheduler stepped; the loop's progress
  there is what moves with the state, as a checkpoint Lightning saves there would hold it.
- **A peer lost** in the step's forward or backward (DDP's all-reduce) fails that call inside the
  optimizer's closure: this rank freezes, the group re-forms, and the forward and backward are done
  again from the state the step began with, before the optimizer steps.
- **A warm spare** sets up as a rank does (DDP on the group that communicates nothing), then waits.
  Given a slot, it receives the state and the loop's progress, which Lightning restores as from a
  checkpoint; its data loader skips the batches of the epoch already trained (a loader that can
  only restart an epoch from its start would read other batches than the rank it replaces).
- **No spare**: each checkpoint Lightning saves is reported, and the job restarts from the newest,
  restored by Lightning itself, with the same data skipping.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any, cast

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy

from job_agent import wire
from job_agent.frameworks.lightning import AgentEnvironment
from job_agent.rank.agent import RankAgent
from job_agent.rank.driven import DrivenSteps


class _Progress:
    """The fit loop's progress as of the last complete step (tracked as an extra): the same on
    every replica."""

    def __init__(self) -> None:
        self.kept: dict[str, Any] = {}
        self.received: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.kept)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.received = copy.deepcopy(state)
        self.kept = copy.deepcopy(state)  # held now: what this rank says it holds, as the donor


class _Resumable:
    """The training data loader, which skips the batches of the epoch the fit loop restored as
    trained (a spare starting mid-epoch, a restart from a checkpoint saved mid-epoch)."""

    def __init__(self, loader: Any, trainer: pl.Trainer) -> None:
        self.loader, self.trainer = loader, trainer

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:  # sampler, batch_size, dataset...: the loader's
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator[Any]:
        fit_loop = self.trainer.fit_loop
        epoch_loop = fit_loop.epoch_loop
        if not epoch_loop.restarting:
            return iter(self.loader)
        # The epoch's order is drawn as its iterator starts: the sampler is told the epoch first
        # (Lightning tells it later, once this iterator exists).
        _set_sampler_epoch(
            self.loader, int(getattr(fit_loop.epoch_progress.current, "processed", 0))
        )
        it = iter(self.loader)
        done = int(getattr(epoch_loop.batch_progress.current, "processed", 0))
        for _ in range(done if done < len(self.loader) else 0):
            next(it)
        return it


class LiveDDPStrategy(DDPStrategy):
    """Lightning's DDP strategy under the rank agent (see the module's docstring)."""

    def __init__(self, agent: RankAgent, **kwargs: Any) -> None:
        super().__init__(cluster_environment=AgentEnvironment(agent), **kwargs)
        self.agent = agent
        agent.checkpoints_by_framework = True  # the fallback resumes from Lightning's own
        self._steps = DrivenSteps(agent)
        self._progress = _Progress()
        self._k: int | None = None  # the step in flight
        self._call: tuple[tuple[Any, ...], dict[str, Any]] | None = None  # its training_step's
        self._restoring = False  # a spare given a slot, until its first step

    @property
    def root_device(self) -> torch.device:
        """The agent's device for this process (a spare's GPU is the one its node gave it, which
        Lightning's list of the job's devices need not hold)."""
        return self.agent.device

    # --- set-up: what the state is made of, then the job's group (a spare: its slot and state)

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)  # DDP on the group that communicates nothing, the optimizers
        if not trainer.lightning_module.automatic_optimization:
            raise ValueError(
                "LiveDDPStrategy: manual optimization is not supported yet: its training_step "
                "steps the optimizer itself, so doing it again after a peer's loss would apply "
                "its update twice"
            )
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                "LiveDDPStrategy: accumulate_grad_batches > 1 is not supported yet: a step done "
                "again would need every micro-batch of its window"
            )
        callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]
        if not any(isinstance(c, _Boundary) for c in callbacks):
            callbacks.append(_Boundary(self))
        # Lightning broadcasts a SIGTERM flag from rank 0 before every batch, a collective outside
        # any step that a spare taking a slot would do and its peers would not. Under the agent a
        # SIGTERM is the job's: its coordinator stops every rank in order.
        epoch_loop: Any = trainer.fit_loop.epoch_loop
        epoch_loop._broadcast_sigterm_tensor = lambda: None
        connector = trainer._checkpoint_connector
        restore = self.agent.settings.restore
        if restore is not None:  # the job restarted from a checkpoint Lightning saved
            connector._restore_modules_and_callbacks(str(restore))
            assert connector._loaded_checkpoint
            self.agent.completed_step = int(connector._loaded_checkpoint["global_step"]) - 1
        optimizers = trainer.optimizers
        if len(optimizers) != 1:
            raise ValueError("LiveDDPStrategy: one optimizer (configure_optimizers) is supported")
        extras: dict[str, Any] = {"progress": self._progress}
        for i, config in enumerate(trainer.lr_scheduler_configs):
            extras[f"sched{i}"] = config.scheduler
        self._progress.kept = trainer.fit_loop.state_dict()
        assert self.model is not None
        self.agent.track(self.model, optimizers[0], **extras)
        was_spare = self.agent.is_spare
        total = (
            trainer.max_steps if trainer.max_steps > 0 else int(trainer.estimated_stepping_batches)
        )
        self._steps.begin(total)
        if was_spare:  # the state moved in: Lightning restores the loop as from a checkpoint
            self._restoring = True
            connector._loaded_checkpoint = {
                "loops": {"fit_loop": self._progress.received or {}},
                "optimizer_states": [o.state_dict() for o in optimizers],
                "lr_schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
            }

    # Before the job's group forms (set-up: the log directory Lightning agrees on, its barriers),
    # the group communicates nothing: every rank computes the same, and a warm spare has no peers.
    # Nor does a spare between its slot and its first step: it restores what the others hold.

    def _alone(self) -> bool:
        return self.agent.generation < 0 or self._restoring

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj if self._alone() else super().broadcast(obj, src)

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not self._alone():
            super().barrier(*args, **kwargs)

    def reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return tensor if self._alone() else super().reduce(tensor, *args, **kwargs)

    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not trainer.training:
            return dataloader
        return _Resumable(dataloader, trainer)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        super().save_checkpoint(checkpoint, filepath, storage_options)
        if self.is_global_zero:
            step = int(checkpoint.get("global_step", 0)) - 1
            self.agent._send(wire.CheckpointSaved(step=step, path=str(filepath)))

    # --- the step: its forward and backward, done again after a peer's loss

    def _enter(self, k: int) -> None:
        self._k, self._restoring = k, False
        self._steps.enter(k)

    def _complete(self, trainer: pl.Trainer) -> None:
        if self._k is not None:
            self._progress.kept = trainer.fit_loop.state_dict()
            self._steps.complete(self._k)
            self._k = None

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._call = (args, kwargs)
        try:
            return super().training_step(*args, **kwargs)
        except Exception as e:
            if self._k is None or not self._steps.failed(self._k, e):
                raise
        return self._again(backward=None)

    def backward(self, closure_loss: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        except Exception as e:
            if self._k is None or not self._steps.failed(self._k, e):
                raise
        return self._again(backward=(optimizer, args, kwargs))

    def _again(self, backward: tuple[Any, tuple[Any, ...], dict[str, Any]] | None) -> Any:
        """The step's forward (and, where its backward failed, its backward) done again from the
        state the step began with, until no peer is lost in it."""
        assert self._k is not None and self._call is not None
        while True:
            try:
                self._steps.enter(self._k)
                out = super().training_step(*self._call[0], **self._call[1])
                if backward is None:
                    return out
                loss = cast(torch.Tensor, out["loss"] if isinstance(out, dict) else out)
                optimizer, args, kwargs = backward
                return super().backward(loss, optimizer, *args, **kwargs)
            except Exception as e:
                if not self._steps.failed(self._k, e):
                    raise


class _Boundary(Callback):
    """Lightning's own hooks, told to the agent: where each step begins and ends, and the end."""

    def __init__(self, strategy: LiveDDPStrategy) -> None:
        self.strategy = strategy

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.strategy._enter(trainer.global_step)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        self.strategy._complete(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.strategy._steps.finish()
