"""`make demo`: a 4-rank job loses a rank to SIGKILL, later another to a hang; both are live-migrated.

Everything is real: the embedded Temporal dev server with its web UI, the control worker, the job's
coordinator and worker, five torch.distributed processes (gloo on CPU) and a warm spare. At the end the
final state is compared with an uninterrupted reference run of the same job. Exit 0 only if every
injected failure was migrated live, no completed step was recomputed, and the states are bitwise equal.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import tempfile
import time
from pathlib import Path

from job_agent.jobs import request, running_jobs
from torchpass.incidents_cli import format_outcome
from torchpass.job import JobResult, JobSpec
from workers.control import control_worker
from workers.job import run_job
from workers.temporal import start_dev_server

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "train_dp.py"
STEPS = 160
INJECT = (("kill", 1, 40), ("hang", 2, 110))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spec(state_dir: Path, job_id: str, spares: int) -> JobSpec:
    return JobSpec(
        job_id=job_id,
        script=SCRIPT,
        args=("--steps", str(STEPS), "--width", "512", "--depth", "4"),
        nproc=4,
        spares=spares,
        state_dir=state_dir,
        hang_timeout=1.5,
        checkpoint_every=50,
    )


async def _inject_when_running(state_dir: Path, job_id: str) -> None:
    deadline = time.monotonic() + 60
    while not any(j["job_id"] == job_id for j in running_jobs(state_dir)):
        if time.monotonic() > deadline:
            raise TimeoutError("the job never registered")
        await asyncio.sleep(0.1)
    for action, rank, step in INJECT:
        msg = {"t": "inject", "action": action, "slot": rank, "after_step": step}
        reply = await asyncio.to_thread(request, state_dir, job_id, msg)
        print(f"demo: scheduled {action} of rank {rank} at step {step}: {reply['t']}", flush=True)


def _verdict(result: JobResult, reference: JobResult, ui: str) -> bool:
    ok = True
    print("\n=== incidents ===")
    for o in result.incidents:
        print(format_outcome(o))
        print(f"UI         {ui}/namespaces/default/workflows/{o.incident_id.split('/')[0]}\n")
        ok &= o.success and o.steps_recomputed == 0
    if len(result.incidents) != len(INJECT):
        print(f"demo: expected {len(INJECT)} incidents, got {len(result.incidents)}")
        ok = False
    same = result.final_digest is not None and result.final_digest == reference.final_digest
    print("=== final state ===")
    print(f"reference run   {reference.final_digest}")
    print(f"migrated run    {result.final_digest}")
    print("bitwise identical" if same else "DIFFERENT from the reference")
    return ok and same and result.ok and reference.ok


async def main() -> int:
    ui_port = _free_port()
    env = await start_dev_server(ui_port)
    ui = f"http://127.0.0.1:{ui_port}"
    print(f"demo: Temporal dev server up, web UI at {ui}", flush=True)
    with tempfile.TemporaryDirectory(prefix="torchpass-demo-") as tmp:
        state_dir = Path(tmp)
        async with env, control_worker(env.client):
            t0 = time.monotonic()
            reference = await run_job(_spec(state_dir, "demo-reference", spares=0), env.client)
            print(f"demo: reference run {reference.status} in {time.monotonic() - t0:.1f} s", flush=True)
            t0 = time.monotonic()
            job = asyncio.create_task(run_job(_spec(state_dir, "demo-migrate", spares=1), env.client))
            await _inject_when_running(state_dir, "demo-migrate")
            result = await job
            print(f"demo: migrated run {result.status} in {time.monotonic() - t0:.1f} s", flush=True)
    ok = _verdict(result, reference, ui)
    print("\ndemo: PASS" if ok else "\ndemo: FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
