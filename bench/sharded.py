"""Recovery of the FSDP2 and HSDP examples, side by side in one invocation.

`examples/train_fsdp.py` on 4 ranks (gloo on loopback), one rank SIGKILLed at the same step:

  1. HSDP 2 x 2 (two replica groups of two shards): the lost shard is rebuilt from its replica,
     live;
  2. plain FSDP2 (one group of four shards): no replica of the lost shard exists, so the job
     restarts from its sharded checkpoint (the brief's "failures exceeding parallelism redundancy").

Measured, from each incident's outcome: the recovery time (failure observed -> every rank in its
next step), the steps recomputed, the bytes of state moved. Writes its block of docs/benchmarks.md.
Run: `.venv/bin/python -m bench.sharded` (about 2 minutes).
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
RANKS, STEPS, KILL_RANK, KILL_STEP, CKPT_EVERY = 4, 40, 3, 25, 10
MODEL = ("--width", "512", "--depth", "4", "--batch", "32", "--samples", "4096")


async def one(client: object, d: Path, replicas: int) -> MigrationOutcome:
    spec = JobSpec(
        job_id=f"sharded-{replicas}",
        script=ROOT / "examples" / "train_fsdp.py",
        args=("--steps", str(STEPS), "--replicas", str(replicas), *MODEL),
        nproc=RANKS,
        spares=1,
        state_dir=d,
        hang_timeout=3.0,
        checkpoint_every=CKPT_EVERY,
    )
    result = await run_with_kills(client, spec, ((KILL_RANK, KILL_STEP),))  # type: ignore[arg-type]
    assert result.ok and len(result.incidents) == 1, result.error
    (o,) = result.incidents
    assert o.recovery_seconds is not None, o
    return o


async def main() -> int:
    env = await start_dev_server()
    with tempfile.TemporaryDirectory(prefix="torchpass-sharded-") as tmp:
        async with env, control_worker(env.client):
            hsdp = await one(env.client, Path(tmp) / "hsdp", 2)
            fsdp = await one(env.client, Path(tmp) / "fsdp", 1)
    rows = []
    for name, o in (
        ("HSDP 2 x 2 (a replica of the shard left)", hsdp),
        ("FSDP2, 4 shards (none)", fsdp),
    ):
        moved = f"{o.proof.bytes / 1e6:.1f} MB" if o.proof else "none (checkpoint)"
        rows.append(
            f"| {name} | {o.disposition.value} | {o.recovery_seconds:.2f} s | {o.steps_recomputed} "
            f"| {moved} |"
        )
    lines = [
        f"## FSDP2 and HSDP recovery ({datetime.now(UTC):%Y-%m-%d}, `python -m bench.sharded`)",
        "",
        f"`examples/train_fsdp.py {' '.join(MODEL)}`, {RANKS} ranks on this machine "
        f"({os.cpu_count()} cores, gloo on loopback), rank {KILL_RANK} SIGKILLed at step "
        f"{KILL_STEP}, checkpoints every {CKPT_EVERY} steps, one warm spare. One run each, in one "
        "invocation.",
        "",
        "| layout | outcome | recovery (observed -> training) | steps recomputed | state moved |",
        "|---|---|---|---|---|",
        *rows,
        "",
        "The restart's time covers starting every rank again (interpreter, torch, the model) and "
        "loading the checkpoint; the live recovery moves one shard from its replica.",
    ]
    write_block("sharded", lines)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
