"""`examples/train_hf.py` whose rank 1 is SIGKILLed as step 9 ends (global step 10), before the
Trainer logs: its peer is lost in the loss gather of that logging, between two steps."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import train_hf


class LostAfterStep9(TrainerCallback):
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == 10 and args.process_index == 1:
            os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    train_hf.main([LostAfterStep9()])
