"""examples/train_dp.py with faults a real rank can have, each armed once by a file named in the
environment (so the ranks restarted after the fault behave):

- FAULT_CORRUPT_ONCE: the next rank that installs a received state changes one parameter's value
  right after `load_state_dict` (as a buggy load hook would): the bytes arrived intact, the state it
  holds does not match the donor's.
- FAULT_SKIP_ONCE with FAULT_SKIP_SLOT: after the next re-formed world, that rank skips a step.
- FAULT_FLIP_ONCE with FAULT_FLIP_SLOT and FAULT_FLIP_STEP: that rank's memory goes bad once it
  completed that step (one parameter's value changes, as a flipped bit would): silent data
  corruption. With FAULT_FLIP_STEP=redone: the first step it completes after a re-formed world (the
  recovery's redone step).
- FAULT_CUDA_ONCE with FAULT_CUDA_SLOT and FAULT_CUDA_STEP: that rank's step ends in the error a
  CUDA driver fault raises in torch (no GPU here: the exception is the stand-in, the rest of the
  path is real).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import train_dp

from job_agent import RankAgent
from job_agent.rank.state import Stateful


def _once(variable: str) -> bool:
    """True for the first process to claim the armed file (rename is atomic), False after."""
    path = os.environ.get(variable)
    if not path:
        return False
    try:
        os.rename(path, f"{path}.used")
    except FileNotFoundError:
        return False
    return True


class FaultyAgent(RankAgent):
    def track(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        **extras: Stateful,
    ) -> None:
        super().track(model, optimizer, **extras)
        model.register_load_state_dict_post_hook(self._corrupt)

    def _corrupt(self, module: torch.nn.Module, incompatible: Any) -> None:
        if _once("FAULT_CORRUPT_ONCE"):
            with torch.no_grad():
                next(module.parameters()).view(-1)[0] += 1.0

    def _complete_step(self, step: int) -> None:
        super()._complete_step(step)
        flip = (os.environ.get("FAULT_FLIP_SLOT"), os.environ.get("FAULT_FLIP_STEP"))
        at = "redone" if self.generation > 0 else str(step)
        if flip in ((str(self.slot), str(step)), (str(self.slot), at)) and _once("FAULT_FLIP_ONCE"):
            assert self._tracked is not None
            with torch.no_grad():
                next(self._tracked.model.parameters()).view(-1)[3] *= -1.0

    def _after_step(self) -> None:
        super()._after_step()
        cuda = (os.environ.get("FAULT_CUDA_SLOT"), os.environ.get("FAULT_CUDA_STEP"))
        if cuda == (str(self.slot), str(self.completed_step + 1)) and _once("FAULT_CUDA_ONCE"):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def _regroup(self, generation: int, world_size: int) -> bool:
        formed = super()._regroup(generation, world_size)
        if (
            formed
            and generation > 0
            and str(self.slot) == os.environ.get("FAULT_SKIP_SLOT")
            and _once("FAULT_SKIP_ONCE")
        ):
            self.completed_step += 1
        return formed


if __name__ == "__main__":
    train_dp.main(FaultyAgent)
