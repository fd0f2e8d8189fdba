"""Hugging Face's `Trainer`, migrated live: `LiveTrainer` is the Trainer with the agent's step
boundary inside its own loop. Two lines in a script:

    agent = RankAgent()            # torchpass: first, before TrainingArguments (it forms the group)
    args = TrainingArguments(...)
    trainer = LiveTrainer(model=model, args=args, train_dataset=ds, agent=agent)  # torchpass
    trainer.train()
    trainer.save_model()

Everything else is the Trainer's own: its loop, scheduler, gradient accumulation, mixed precision,
DataLoader and sampler, callbacks, logging, `save_strategy` checkpoints and `save_model`.

- **A step** is one optimizer update: it begins as the Trainer draws its micro-batches
  (`get_batch_samples`) and is complete once the optimizer and scheduler stepped (`on_step_end`).
  The agent seeds torch's RNG per (seed, step, rank) as each step begins, so dropout and anything a
  step draws is the same when the step is done again, and on a spare.
- **A peer lost** in one of the step's collectives (the token count gathered for the loss, DDP's
  gradient all-reduce, its buffer broadcast) fails the call it happened in: this rank freezes, the
  group re-forms with a spare, and the step's work so far (the gather, then each micro-batch, each
  under the gradient synchronisation it had) is done again inside that very call, from the state
  the step began with. The Trainer's loop never sees it.
- **A warm spare** builds the model, optimizer, scheduler and DDP wrapper as a rank does, then
  waits. Given a slot, it receives the state of the last complete step and resumes the Trainer from
  it (`train(resume_from_checkpoint=...)` with the Trainer's own data skipping), as the rank it
  replaces.
- **Between steps** (logging's gather, evaluation, a checkpoint's barrier): a peer lost there costs
  that log line, evaluation or checkpoint, which are skipped on this rank, never the training state.
- **No spare** (the fallback): each checkpoint the Trainer saves is reported, and the job restarts
  from the newest with `train(resume_from_checkpoint=...)`, recomputing the steps since.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from accelerate.state import AcceleratorState, PartialState
from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import ExportableState, TrainerState

from job_agent import wire
from job_agent.rank.agent import RankAgent
from job_agent.rank.driven import DrivenSteps

log = logging.getLogger("torchpass.hf")
STATE_FILE = "trainer_state.json"  # the Trainer's own name for it
# What a spare needs of the Trainer's state beyond its step: the best so far, and what was seen.
_KEPT = ("best_metric", "best_global_step", "best_model_checkpoint", "num_input_tokens_seen")


class _TrainerState:
    """The part of the Trainer's state that moves with a rank's (tracked as an extra): the same on
    every replica."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.received: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {name: getattr(self.trainer.state, name) for name in _KEPT}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.received = {name: state.get(name) for name in _KEPT}
        for name, value in self.received.items():  # held now, as the donor holds it
            setattr(self.trainer.state, name, value)


@dataclass
class _Step:
    """The work of the step in flight so far, kept to do it again after a peer's loss."""

    k: int
    counted: tuple[list[Any], torch.device] | None = None  # what the token count was made from
    micro: list[tuple[Any, bool]] = field(default_factory=list)  # each micro-batch, and its sync


class LiveTrainer(Trainer):
    """`transformers.Trainer` under the rank agent (see the module's docstring)."""

    def __init__(self, *args: Any, agent: RankAgent, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.agent = agent
        agent.checkpoints_by_framework = True  # the fallback resumes from the Trainer's own
        self._steps = DrivenSteps(agent)
        self._step: _Step | None = None
        self._kept = _TrainerState(self)
        self._from_agent = False  # resuming from the state the agent holds, not from files
        self.add_callback(_Boundary(self))

    # --- training, in two phases: what the state is made of, then the Trainer's own loop

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ) -> Any:
        agent = self.agent
        max_steps = self._max_steps()
        restore = agent.settings.restore
        if restore is not None:  # the job restarted from a checkpoint the Trainer saved
            resume_from_checkpoint = str(restore)
            agent.completed_step = _saved_step(resume_from_checkpoint) - 1
        self.create_optimizer_and_scheduler(num_training_steps=max_steps)
        # Wrapped now, on the group that communicates nothing, as a spare's must be: the agent moves
        # the wrapper onto the job's group as it forms, and onto each group after a failure.
        self.model_wrapped = self.accelerator.prepare_model(self.model)
        extras: dict[str, Any] = {"sched": self.lr_scheduler, "trainer": self._kept}
        if getattr(self.accelerator, "scaler", None) is not None:  # float16 on a GPU
            extras["scaler"] = self.accelerator.scaler
        agent.track(self.model_wrapped, self.optimizer, **extras)
        was_spare = agent.is_spare
        self._steps.begin(max_steps)
        if was_spare:  # it holds a slot now, and the state of the step it starts at
            _take_rank(agent.rank)
            resume_from_checkpoint = self._state_dir(max_steps)
            self._from_agent = True
        self._created_lr_scheduler = False  # the scheduler tracked is the one the loop steps
        try:
            out = super().train(resume_from_checkpoint, trial, ignore_keys_for_eval, **kwargs)
        finally:
            if self._from_agent and isinstance(resume_from_checkpoint, str):
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(resume_from_checkpoint, STATE_FILE))
                    os.rmdir(resume_from_checkpoint)
        self._steps.finish()
        return out

    def _max_steps(self) -> int:
        values = self.set_initial_training_values(self.args, self.get_train_dataloader())
        return int(values[-1])

    def _state_dir(self, max_steps: int) -> str:
        """A directory holding the Trainer's state as of the step this spare starts at, for the
        Trainer to resume from (the model, optimizer and scheduler are in memory already)."""
        exportable = [*self.callback_handler.callbacks, self.control]
        stateful: list[Any] = [cb for cb in exportable if isinstance(cb, ExportableState)]
        state = TrainerState(stateful_callbacks=stateful)
        state.compute_steps(self.args, max_steps)
        state.train_batch_size = self._train_batch_size
        state.global_step = self.agent.completed_step + 1
        for name, value in (self._kept.received or {}).items():
            setattr(state, name, value)
        where = tempfile.mkdtemp(prefix="torchpass-resume-")
        state.save_to_json(os.path.join(where, STATE_FILE))
        return where

    # Resuming from the agent's state: what the Trainer would load from files is in memory.

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if not self._from_agent:
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if not self._from_agent:
            super()._load_optimizer_and_scheduler(checkpoint)

    def _load_scaler(self, checkpoint: str | None) -> None:
        if not self._from_agent:
            super()._load_scaler(checkpoint)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        pass  # the agent seeds every step from (seed, step, rank)

    # --- the step: where it begins, its work, done again after a peer's loss

    def get_batch_samples(
        self, epoch_iterator: Iterator[Any], num_batches: int, device: torch.device
    ) -> tuple[list[Any], Any]:
        k = self.state.global_step
        self._steps.enter(k)
        self._step = _Step(k)
        return super().get_batch_samples(epoch_iterator, num_batches, device)

    def _get_num_items_in_batch(self, batch_samples: list[Any], device: torch.device) -> Any:
        step = self._step
        if step is None:  # outside training (evaluation)
            return super()._get_num_items_in_batch(batch_samples, device)
        step.counted = (batch_samples, device)
        return self._survive(
            step, lambda: super(LiveTrainer, self)._get_num_items_in_batch(batch_samples, device)
        )

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        step = self._step
        if step is None:
            return super().training_step(model, inputs, num_items_in_batch)
        synced = self.accelerator.gradient_state.sync_gradients
        if not step.micro:
            self._steps.reseed(step.k)  # whatever drawing the batches took (a new iterator's seed)
        step.micro.append((inputs, synced))
        return self._survive(
            step, lambda: super(LiveTrainer, self).training_step(model, inputs, num_items_in_batch)
        )

    def _survive(self, step: _Step, work: Callable[[], Any]) -> Any:
        """`work`, the step's latest piece; after a peer's loss, the step's work so far again."""
        try:
            return work()
        except Exception as e:
            if not self._steps.failed(step.k, e):
                raise
        while True:
            try:
                return self._redo(step)
            except Exception as e:
                if not self._steps.failed(step.k, e):
                    raise

    def _redo(self, step: _Step) -> Any:
        """Step `step.k`'s work so far, done again from the state it began with."""
        self._steps.enter(step.k)
        out: Any = None
        if step.counted is not None:
            out = counted = super()._get_num_items_in_batch(*step.counted)
        else:
            counted = None
        model, state = self.model_wrapped, self.accelerator.gradient_state
        last = state.sync_gradients
        if step.micro:
            self._steps.reseed(step.k)
        for inputs, synced in step.micro:
            state._set_sync_gradients(synced)
            quiet = contextlib.nullcontext() if synced else self.accelerator.no_sync(model)
            with quiet:
                out = super().training_step(model, inputs, counted)
        state._set_sync_gradients(last)
        return out

    def _complete(self) -> None:
        """The optimizer and scheduler stepped: the step is complete."""
        if self._step is not None:
            self._steps.complete(self._step.k)
            self._step = None

    # --- between steps: what a peer's loss there costs is that work, never the state

    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
        try:
            super()._maybe_log_save_evaluate(*args, **kwargs)
        except Exception as e:
            if not self._steps.failed(None, e):
                raise
            log.warning(
                "a peer was lost while rank %d logged, evaluated or saved after step %d: that work "
                "is skipped, training goes on",
                self.agent.rank,
                self.state.global_step - 1,
            )


class _Boundary(TrainerCallback):
    """The Trainer's own hooks, told to the agent: a step's end, and each checkpoint saved."""

    def __init__(self, trainer: LiveTrainer) -> None:
        self.trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer._complete()

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if os.path.isdir(path):
            self.trainer.agent._send(wire.CheckpointSaved(step=state.global_step - 1, path=path))


def _take_rank(rank: int) -> None:
    """A spare given slot `rank`: accelerate's view of this process (which shard of the data it
    reads, whether it saves) becomes that rank's."""
    for shared in (PartialState._shared_state, AcceleratorState._shared_state):
        if shared:
            shared["process_index"] = rank


def _saved_step(checkpoint: str) -> int:
    """The number of steps a checkpoint the Trainer saved had completed."""
    with open(os.path.join(checkpoint, STATE_FILE)) as f:
        return int(json.load(f)["global_step"])
