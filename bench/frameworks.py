"""Recovery under a framework's own loop, beside the hand-written form, in one invocation.

Two ranks (gloo on loopback), one SIGKILLed at the same step, a GPT of the same shape (2 layers,
width 64, 32-token windows, dropout) trained three ways:

  1. hand-written: `examples/train_gpt.py`, the agent's loop form, one warm spare;
  2. Hugging Face's Trainer: `examples/train_hf.py` (`LiveTrainer`, 2 micro-batches a step), one
     warm spare;
  3. the same Trainer with no spare: the job restarts from the Trainer's own latest checkpoint.

Measured from each incident's outcome: kill observed -> every rank in its next step, and the steps
recomputed. Writes its block of docs/benchmarks.md. Run: `.venv/bin/python -m bench.frameworks`
(about a minute).
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

from bench import write_block
from bench.recovery import run_with_kills
from torchpass.dev.server import start_dev_server
from torchpass.incident.outcome import MigrationOutcome
from torchpass.job import JobSpec
from workers.control import control_worker

ROOT = Path(__file__).resolve().parent.parent
RANKS, STEPS, KILL_RANK, KILL_STEP, SAVE_EVERY = 2, 40, 1, 25, 10
SHAPE = ("--width", "64", "--layers", "2")


async def one(
    client: object, d: Path, name: str, script: str, args: tuple[str, ...], spares: int
) -> MigrationOutcome:
    spec = JobSpec(
        job_id=name,
        script=ROOT / "examples" / script,
        args=("--steps", str(STEPS), *SHAPE, *args),
        nproc=RANKS,
        spares=spares,
        state_dir=d,
        hang_timeout=3.0,
        checkpoint_every=SAVE_EVERY,
    )
    result = await run_with_kills(client, spec, ((KILL_RANK, KILL_STEP),))  # type: ignore[arg-type]
    assert result.ok and len(result.incidents) == 1, result.error
    (o,) = result.incidents
    assert o.recovery_seconds is not None, o
    return o


async def main() -> int:
    env = await start_dev_server()
    with tempfile.TemporaryDirectory(prefix="torchpass-frameworks-") as tmp:
        d = Path(tmp)
        hf = ("--out", str(d / "out"), "--save-steps", str(SAVE_EVERY))
        hf_none = ("--out", str(d / "out-none"), "--save-steps", str(SAVE_EVERY))
        async with env, control_worker(env.client):
            runs = [
                (
                    "hand-written loop (`train_gpt.py`)",
                    await one(env.client, d / "gpt", "fw-gpt", "train_gpt.py", (), 1),
                ),
                (
                    "Hugging Face Trainer (`LiveTrainer`)",
                    await one(env.client, d / "hf", "fw-hf", "train_hf.py", hf, 1),
                ),
                (
                    "Hugging Face Trainer, no spare",
                    await one(env.client, d / "hf-none", "fw-hf-none", "train_hf.py", hf_none, 0),
                ),
            ]
    rows = [
        f"| {name} | {o.disposition.value} | {o.recovery_seconds:.2f} s | {o.steps_recomputed} |"
        for name, o in runs
    ]
    lines = [
        f"## Under a framework's loop ({datetime.now(UTC):%Y-%m-%d}, `python -m bench.frameworks`)",
        "",
        f"A GPT of one shape (width 64, 2 layers, 32-token windows, dropout) on {RANKS} ranks on "
        f"this machine ({os.cpu_count()} cores, gloo on loopback), rank {KILL_RANK} SIGKILLed at "
        f"step {KILL_STEP}, checkpoints every {SAVE_EVERY} steps. One run each, in one invocation.",
        "",
        "| path | outcome | kill observed -> training again | steps recomputed |",
        "|---|---|---|---|",
        *rows,
        "",
        "Fairness: the Trainer's step is 2 micro-batches (gradient accumulation) against the "
        "hand-written loop's one, and its spare resumes the Trainer (its loop set up again, the "
        "data skipped to the step) after it received the state, which the hand-written spare does "
        "not; the no-spare row restarts every rank (interpreter, torch, transformers, the model) "
        "and loads the Trainer's checkpoint.",
    ]
    write_block("frameworks", lines)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
