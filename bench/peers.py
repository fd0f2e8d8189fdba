"""One rank SIGKILLed, torchpass against torchrun, side by side in one invocation.

The same DDP training (8 x Linear(1024, 1024) + AdamW: about 100 MB of model + optimizer state per
rank, 4 ranks, gloo on loopback) killed once at the same step:

  1. under torchpass with the agent (`examples/train_ddp.py`, stock DDP, one warm spare): live
     migration;
  2. under torchrun `--max-restarts 3` (`examples/torchrun_ddp.py`, an ordinary torchrun script
     saving its checkpoint every 10 steps from rank 0 and resuming from it): every worker restarted;
  3. under torchft 0.2.0 (`bench/torchft_ddp.py`, the same training on torchft's Manager, DDP and
     Optimizer wrappers; 4 replica groups of one rank, 3 needed for a quorum), in a virtualenv of
     its own (`bench/torchft_peer.py` makes it), with its default timeouts and with tuned ones; the
     killed replica's replacement is started the instant the kill is sent (a scheduler would take
     longer).

Measured: the time from the kill until every rank trains again (torchpass: the outcome's recovery
time, failure observed -> every rank in its next step; the kill is observed within milliseconds, as
the connection closes. torchrun: the kill -> the last rank's first step begun by a restarted worker,
from the script's own per-step log; torchft: the kill -> the replacement's first step after healing
that the quorum committed, the survivors having gone on before), the steps recomputed, and the
rank-seconds lost (each rank's time from the kill to its next training step, summed, plus ranks x
steps recomputed x the median step time). Writes its block of docs/benchmarks.md. Run:
`.venv/bin/python -m bench.peers` (about 12 minutes).
"""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from bench import read_step_log, write_block
from bench.recovery import run_with_kills
from bench.torchft_peer import TUNED, torchft_run
from torchpass.dev.server import start_dev_server
from torchpass.job import JobSpec
from workers.control import control_worker

ROOT = Path(__file__).resolve().parent.parent
RANKS, STEPS, KILL_RANK, KILL_STEP, CKPT_EVERY = 4, 40, 1, 15, 10
MODEL = ("--width", "1024", "--depth", "8", "--batch", "32", "--samples", "4096")


async def torchpass_run(d: Path) -> tuple[float, int, int]:
    """(kill -> training again, steps recomputed, state bytes moved) under torchpass."""
    env = await start_dev_server()
    async with env, control_worker(env.client):
        spec = JobSpec(
            job_id="peers-torchpass",
            script=ROOT / "examples" / "train_ddp.py",
            args=("--steps", str(STEPS), *MODEL, "--accum", "1", "--bucket-mb", "25"),
            nproc=RANKS,
            spares=1,
            state_dir=d,
            hang_timeout=3.0,
            checkpoint_every=CKPT_EVERY,
        )
        result = await run_with_kills(env.client, spec, ((KILL_RANK, KILL_STEP),))
    assert result.ok and len(result.incidents) == 1, result.error
    o = result.incidents[0]
    assert o.success and o.recovery_seconds is not None, o
    return o.recovery_seconds, o.steps_recomputed, o.proof.bytes if o.proof else 0


def torchrun_run(d: Path) -> tuple[float, int, float] | str:
    """(kill -> training again, steps recomputed, median step seconds) under torchrun
    --max-restarts, or why the job never trained again."""
    log = d / "steps.log"
    cmd = [
        str(Path(sys.executable).with_name("torchrun")),
        "--standalone",
        f"--nproc-per-node={RANKS}",
        "--max-restarts=3",
        "--monitor-interval=0.1",
        str(ROOT / "examples" / "torchrun_ddp.py"),
        "--steps",
        str(STEPS),
        *MODEL,
        "--ckpt",
        str(d / "ckpt.pt"),
        "--ckpt-every",
        str(CKPT_EVERY),
        "--step-log",
        str(log),
    ]
    # torch 2.13's torchrun hands its restarted workers the rendezvous store of the round before,
    # where gloo finds the dead workers' addresses ("connectFullMesh failed"); torchrun's own switch
    # to give each round its store is this variable.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    out = (d / "torchrun.out").open("w")
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    victim, killed_at = None, 0.0
    while victim is None and proc.poll() is None:
        for rank, step, pid, _, event in read_step_log(log):
            if rank == KILL_RANK and step == KILL_STEP and event == "begin":
                victim = pid
        time.sleep(0.01)
    assert victim is not None, "torchrun's job ended before the kill"
    before = {pid for _, _, pid, _, _ in read_step_log(log)}
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)
    code = proc.wait(600)
    rows = read_step_log(log)
    if code != 0 and not any(pid not in before for _, _, pid, _, _ in rows):
        text = (d / "torchrun.out").read_text()
        return (
            f"never trained again: exit code {code} after "
            f"{text.count('Sending process') // (RANKS - 1)} worker-group restart(s), the "
            "restarted workers failing in init_process_group "
            f"({text.count('connectFullMesh failed')} gloo 'connectFullMesh failed' errors)"
        )
    first_new: dict[int, tuple[float, int]] = {}
    for rank, step, pid, t, event in rows:
        if pid not in before and event == "begin":
            first_new.setdefault(rank, (t, step))
    assert len(first_new) == RANKS, first_new
    again = max(t for t, _ in first_new.values()) - killed_at
    done_before = max(
        s for _, s, pid, t, e in rows if pid in before and e == "end" and t <= killed_at
    )
    recomputed = done_before + 1 - min(s for _, s in first_new.values())
    begins = {(r, s, p): t for r, s, p, t, e in rows if e == "begin"}
    steps = [t - begins[(r, s, p)] for r, s, p, t, e in rows if e == "end" and (r, s, p) in begins]
    return again, max(0, recomputed), statistics.median(steps)


ROUNDS = 3  # interleaved: each round runs every case once, so the machine's drift touches all alike
CASES = (
    ("torchpass", "torchpass, agent + stock DDP, 1 warm spare"),
    ("torchrun", "torchrun `--max-restarts 3 --monitor-interval 0.1`, own checkpoint"),
    ("default", "torchft 0.2.0, its default timeouts"),
    ("tuned", "torchft 0.2.0, tuned timeouts"),
)
Run = tuple[float, int, float]  # kill -> training again, steps recomputed, rank-seconds lost


async def _case(name: str, d: Path) -> Run | str:
    if name == "torchpass":
        again, recomputed, _ = await torchpass_run(d)
        return again, recomputed, RANKS * again
    if name == "torchrun":
        result = await asyncio.to_thread(torchrun_run, d)
        if isinstance(result, str):
            return result
        again, recomputed, step = result
        return again, recomputed, RANKS * again + RANKS * recomputed * step
    ft = await asyncio.to_thread(torchft_run, d, name == "tuned")
    if isinstance(ft, str):
        return ft
    again, recomputed, step, waits = ft
    return again, recomputed, waits + RANKS * recomputed * step


def _row(label: str, runs: list[Run | str]) -> tuple[str, float | None]:
    done = [r for r in runs if not isinstance(r, str)]
    failed = [r for r in runs if isinstance(r, str)]
    if not done:
        return f"| {label} | {failed[0]} | | | |", None
    again = statistics.median(r[0] for r in done)
    each = ", ".join(f"{r[0]:.2f}" if not isinstance(r, str) else "never" for r in runs)
    recomputed = "/".join(str(r[1]) for r in done)
    lost = statistics.median(r[2] for r in done)
    note = f" ({len(failed)} of {len(runs)} never trained again: {failed[0]})" if failed else ""
    return f"| {label} | {again:.2f} s | {each} s{note} | {recomputed} | {lost:.1f} |", again


async def main() -> int:
    runs: dict[str, list[Run | str]] = {name: [] for name, _ in CASES}
    with tempfile.TemporaryDirectory(prefix="torchpass-peers-") as tmp:
        for i in range(ROUNDS):
            for name, _ in CASES:
                d = Path(tmp) / f"{name}-{i}"
                d.mkdir()
                runs[name].append(await _case(name, d))
                print(f"round {i + 1}, {name}: {runs[name][-1]}", flush=True)
        (Path(tmp) / "mid").mkdir()
        ft_mid = await asyncio.to_thread(torchft_run, Path(tmp) / "mid", True, True)
        mid: Run | str = ft_mid if isinstance(ft_mid, str) else (ft_mid[0], ft_mid[1], ft_mid[3])
    rows, medians = [], {}
    for name, label in CASES:
        row, medians[name] = _row(label, runs[name])
        rows.append(row)
    rows.append(
        _row("torchft 0.2.0, tuned timeouts, killed 0.1 s into the step (one run)", [mid])[0]
    )
    tp = medians["torchpass"]
    assert tp, runs["torchpass"]
    ratios = ", ".join(
        f"{label.split(',')[0]}{' (' + name + ')' if name in ('default', 'tuned') else ''} "
        f"{peer / tp:.1f}x"
        for name, label in CASES[1:]
        if (peer := medians[name]) is not None
    )
    lines = [
        f"## One rank SIGKILLed: torchpass vs torchrun vs torchft ({datetime.now(UTC):%Y-%m-%d}, "
        "`python -m bench.peers`)",
        "",
        f"The same DDP training, about 100 MB of model + AdamW state per rank, {RANKS} ranks on "
        f"this machine ({os.cpu_count()} cores, gloo on loopback), rank {KILL_RANK} SIGKILLed as "
        f"it began step {KILL_STEP}; the torchrun script saves a checkpoint every {CKPT_EVERY} "
        f"steps. {ROUNDS} rounds, interleaved, in one invocation: the median and each run.",
        "",
        "| | kill -> every rank training again (median) | each run | steps recomputed | "
        "rank-seconds lost (median) |",
        "|---|---|---|---|---|",
        *rows,
        "",
        f"torchpass back to training faster than: {ratios} (target: >= 10x each).",
        "",
        f"torchft's tuned timeouts: {TUNED}. Its survivors go on with 3 replicas once the "
        "lighthouse drops the lost one (5 s by default, about 0.5 s tuned); the time to every rank "
        "training again is then the replacement's start-up and healing, a cold process (the warm "
        "spare is torchpass's). Killed inside the step, after the step's quorum had formed with "
        "the lost replica, torchft 0.2.0's survivors crashed in its DDP communication hook in "
        "every run here (`bench/torchft_peer.py` gives the details).",
    ]
    write_block("peers", lines)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
