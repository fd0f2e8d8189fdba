"""Recovery under a framework's own loop, beside the hand-written form, in one invocation.

Two ranks (gloo on loopback), one SIGKILLed at the same step, each with one warm spare unless said:

  1. a GPT (2 layers, width 64, 32-token windows, dropout), hand-written: `examples/train_gpt.py`,
     the agent's loop form;
  2. the same GPT shape under Hugging Face's Trainer: `examples/train_hf.py` (`LiveTrainer`, 2
     micro-batches a step);
  3. that Trainer with no spare: the job restarts from the Trainer's own latest checkpoint;
  4. an MLP (width 64, dropout, AdamW, cosine) under Lightning Fabric, the agent's loop form:
     `examples/train_fabric.py`;
  5. the same MLP under Lightning's Trainer: `examples/train_lightning.py` (`LiveDDPStrategy`);
  6. that Trainer with no spare: the job restarts from Lightning's own latest checkpoint.

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

from temporalio.client import Client

from bench import write_block
from bench.recovery import run_with_kills
from job_agent import wire
from job_agent.coordinator.jobs import request, wait_until_ready
from torchpass.dev.server import start_dev_server
from torchpass.incident.outcome import MigrationOutcome
from torchpass.job import JobSpec
from workers.control import control_worker
from workers.job import run_job

ROOT = Path(__file__).resolve().parent.parent
RANKS, STEPS, KILL_RANK, KILL_STEP, SAVE_EVERY = 2, 40, 1, 25, 10
LONG = 300
SHAPE = ("--width", "64", "--layers", "2")


async def one(
    client: Client,
    d: Path,
    name: str,
    script: str,
    args: tuple[str, ...],
    spares: int,
    steps: int = STEPS,
) -> MigrationOutcome:
    """One run, one rank SIGKILLed: at KILL_STEP without a spare; with one, a few steps after the
    spare is warm (a job this short can reach KILL_STEP before a spare importing its framework is
    ready, and the recovery would then time the spare's start, not the migration)."""
    spec = JobSpec(
        job_id=name,
        script=ROOT / "examples" / script,
        args=("--steps", str(steps), *args),
        nproc=RANKS,
        spares=spares,
        state_dir=d,
        hang_timeout=3.0,
        checkpoint_every=SAVE_EVERY,
    )
    if not spares:
        result = await run_with_kills(client, spec, ((KILL_RANK, KILL_STEP),))
    else:
        task = asyncio.create_task(run_job(spec, client))
        ready = await asyncio.to_thread(wait_until_ready, d, name)
        at = max(r.step for r in ready.ranks) + 5
        kill = wire.Inject(action=wire.InjectAction.KILL, slot=KILL_RANK, after_step=at)
        await asyncio.to_thread(request, d, name, kill)
        result = await task
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
        pl = ("--out", str(d / "pl"), "--save-steps", str(SAVE_EVERY))
        pl_none = ("--out", str(d / "pl-none"), "--save-steps", str(SAVE_EVERY))
        plans = [
            ("GPT", "hand-written loop (`train_gpt.py`)", "train_gpt.py", SHAPE, 1),
            ("GPT", "Hugging Face Trainer (`LiveTrainer`)", "train_hf.py", (*SHAPE, *hf), 1),
            ("GPT", "Hugging Face Trainer, no spare", "train_hf.py", (*SHAPE, *hf_none), 0),
            ("MLP", "Lightning Fabric, the agent's loop", "train_fabric.py", ("--width", "64"), 1),
            ("MLP", "Lightning Trainer (`LiveDDPStrategy`)", "train_lightning.py", pl, 1),
            ("MLP", "Lightning Trainer, no spare", "train_lightning.py", pl_none, 0),
        ]
        async with env, control_worker(env.client):
            runs = []
            for i, (model, name, script, args, spares) in enumerate(plans):
                steps = STEPS if not spares else LONG  # long enough to outlast a spare's start
                o = await one(env.client, d / f"run{i}", f"fw-{i}", script, args, spares, steps)
                runs.append((model, name, o))
    rows = [
        f"| {model} | {name} | {o.disposition.value} | {o.recovery_seconds:.2f} s "
        f"| {o.steps_recomputed} |"
        for model, name, o in runs
    ]
    lines = [
        f"## Under a framework's loop ({datetime.now(UTC):%Y-%m-%d}, `python -m bench.frameworks`)",
        "",
        f"{RANKS} ranks on this machine ({os.cpu_count()} cores, gloo on loopback), rank "
        f"{KILL_RANK} SIGKILLed a few steps after its warm spare is ready (without a spare, at "
        f"step {KILL_STEP} of {STEPS}), checkpoints every {SAVE_EVERY} steps. One run "
        "each, in one invocation. Compare rows of one model only: the GPT is 2 layers of width 64 "
        "over 32-token windows, the MLP one hidden layer of width 64.",
        "",
        "| model | path | outcome | kill observed -> training again | steps recomputed |",
        "|---|---|---|---|---|",
        *rows,
        "",
        "Fairness: the Hugging Face Trainer's step is 2 micro-batches (gradient accumulation) "
        "against the hand-written loop's one. A Trainer's spare (either framework's) resumes the "
        "Trainer after it received the state (its loop set up again, the data skipped to the "
        "step), which a loop-form spare does not. The no-spare rows restart every rank "
        "(interpreter, torch, the framework, the model) and load the framework's checkpoint.",
    ]
    write_block("frameworks", lines)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
