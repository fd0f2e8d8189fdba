"""Start-up: ranks forked from the fork server (`job_agent.launch.forkserver`) against ranks started
cold.

In one invocation on the embedded dev server, interleaved (cold, forked, cold, forked...) so that a
shared machine's drift hits both alike:
  1. a 4-rank job of one step with one warm spare, from launch to its result: what every job start
     pays;
  2. a checkpoint restart: the unmodified torchrun script `examples/torchrun_ddp.py` under
     `--no-agent`, rank 2 SIGKILLed, every rank restarted from the script's checkpoint: the
     fallback's own time, from fencing the old ranks to every new one training again
     (`FallbackResult.work_seconds`, measured by the job). The fork server is warmed by one
     unmeasured job first: a process's first forked job also pays the server's own imports (about 3
     s here), once. Target: forked start-up <= 1/3 of cold. Writes its block of docs/benchmarks.md.
     Run: `.venv/bin/python -m bench.startup` (about 3 minutes).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from temporalio.client import Client

from bench import write_block
from bench.recovery import run_with_kills
from torchpass.dev.server import start_dev_server
from torchpass.job import JobSpec
from workers.control import control_worker

ROOT = Path(__file__).resolve().parent.parent
ROUNDS = 3
MODES = {"cold": "0", "forked": "1"}


def _job(state: Path, job_id: str) -> JobSpec:
    args = ("--steps", "1", "--width", "128", "--depth", "2")
    return JobSpec(
        job_id=job_id,
        script=ROOT / "examples" / "train_dp.py",
        args=args,
        nproc=4,
        spares=1,
        state_dir=state,
    )


def _restart(state: Path, job_id: str) -> JobSpec:
    args = (
        "--steps",
        "40",
        "--width",
        "64",
        "--ckpt",
        str(state / f"{job_id}.pt"),
        "--ckpt-every",
        "5",
    )
    script = ROOT / "examples" / "torchrun_ddp.py"
    return JobSpec(
        job_id=job_id, script=script, args=args, nproc=4, spares=0, state_dir=state, agent=False
    )


async def _measure(client: Client, d: Path, mode: str, i: int) -> tuple[float, float]:
    """(seconds from launch to the result of the one-step job, seconds of the restart's
    fallback)."""
    os.environ["TORCHPASS_FORK_SERVER"] = MODES[mode]  # read by each job's launcher as it is made
    t0 = time.perf_counter()
    job = await run_with_kills(client, _job(d, f"start-{mode}-{i}"), ())
    start = time.perf_counter() - t0
    restart = await run_with_kills(client, _restart(d, f"restart-{mode}-{i}"), ((2, 17),))
    assert job.ok and restart.ok, (job.error, restart.error)
    [incident] = restart.incidents
    assert incident.fallback is not None, incident
    return start, incident.fallback.work_seconds


async def main() -> int:
    env = await start_dev_server()
    seconds: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="torchpass-bench-") as tmp:
        d = Path(tmp)
        async with env, control_worker(env.client):
            os.environ["TORCHPASS_FORK_SERVER"] = "1"
            warm = await run_with_kills(env.client, _job(d, "warm-up"), ())
            assert warm.ok, warm.error
            for i in range(ROUNDS):
                for mode in MODES:
                    seconds[mode].append(await _measure(env.client, d, mode, i))
    med = {
        m: (statistics.median(s for s, _ in v), statistics.median(r for _, r in v))
        for m, v in seconds.items()
    }
    ratio = med["forked"][0] / med["cold"][0]
    lines = [
        "## Start-up: ranks forked from a warm interpreter, or started cold",
        "",
        f"Measured {datetime.now(UTC):%Y-%m-%d} by `.venv/bin/python -m bench.startup` "
        f"({os.cpu_count()} cores), {ROUNDS} rounds interleaved, medians.",
        "",
        "| | 4 ranks + 1 spare, 1 step: launch to result | checkpoint restart (4 ranks, "
        "--no-agent): fence to training again |",
        "|---|---|---|",
        *(
            f"| {m} | {med[m][0]:.2f} s ({', '.join(f'{s:.2f}' for s, _ in v)}) |"
            f" {med[m][1]:.2f} s ({', '.join(f'{r:.2f}' for _, r in v)}) |"
            for m, v in seconds.items()
        ),
        "",
        f"Forked start-up is {ratio:.2f} of cold (target <= 0.33: "
        f"{'met' if ratio <= 1 / 3 else 'not met'}); the",
        f"restart {med['forked'][1] / med['cold'][1]:.2f} of cold. A cold rank spends most of its "
        "start importing",
        "torch and torch._dynamo (which a script's first optimizer imports); a forked one has them "
        "already.",
    ]
    write_block("startup", lines)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
