"""Node-loss benchmark: a node lost whole -> all ranks training again, with 2 and 4 nodes, ~100 MB
of model + Adam state per rank, beside a single rank killed in the same job (the ratio is what to
read).

Each configuration is one real job: N nodes of one rank each and a spare node with one warm spare,
every node a network namespace of its own when this machine can make them (else a loopback address
of its own), on the embedded Temporal dev server with the real control worker. Rank 1 is killed at
step 10 (a warm spare on the spare node takes it and the spare node warms another), then node 0 (the
node of rank 0) is lost whole at step 40: its agent and its rank killed at once. Every figure is the
incident's own outcome (`recovery_seconds`: failure observed -> training again; the transfer's bytes
and seconds from the proof). Writes its block of docs/benchmarks.md. Run: `.venv/bin/python -m
bench.nodes` (about 5 minutes on 2 cores).
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from temporalio.client import Client

from bench import write_block
from job_agent import wire
from job_agent.coordinator.jobs import request
from torchpass.dev.hosts import fabric
from torchpass.dev.server import start_dev_server
from torchpass.incident.outcome import MigrationOutcome
from torchpass.job import JobResult, JobSpec
from torchpass.models import FailureKind
from workers.control import control_worker
from workers.local_nodes import LocalNode, LocalNodes, coordinator_address, run_on_local_nodes
from workers.temporal import exit_process

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "train_bench.py"
# as bench.recovery: ~100 MB of model + Adam state per rank
MODEL = ("--width", "1024", "--depth", "8")
STEPS = 70
KILL_AT, LOSE_AT = 10, 40


async def one(client: Client, d: Path, n: int) -> JobResult:
    with fabric(n + 1) as hosts:
        *nodes, spare = hosts.hosts
        spec = JobSpec(
            job_id=f"bench-nodes-{n}",
            script=SCRIPT,
            args=("--steps", str(STEPS), *MODEL, "--times", str(d / f"times-{n}.txt")),
            nproc=n,
            spares=0,
            nodes=n,
            host=hosts.coordinator,
            state_dir=d,
            hang_timeout=3.0,
            checkpoint_every=0,
        )
        plan = [LocalNode("spare0", 0, 1, spare.address, spare.prefix)]
        plan += [LocalNode(f"node{i}", 1, 0, h.address, h.prefix) for i, h in enumerate(nodes)]
        local = LocalNodes(spec, plan)
        job = asyncio.create_task(run_on_local_nodes(spec, client, local))
        await coordinator_address(spec)
        kill = wire.Inject(action=wire.InjectAction.KILL, slot=1, after_step=KILL_AT)
        while True:  # the job is up once its coordinator answers with its ranks training
            s = await asyncio.to_thread(request, spec.state_dir, spec.job_id, wire.StatusRequest())
            if isinstance(s, wire.Status) and s.state == "training" and s.spares >= 1:
                break
            assert not job.done(), (await job).error
            await asyncio.sleep(0.1)
        assert isinstance(
            await asyncio.to_thread(request, spec.state_dir, spec.job_id, kill), wire.Ok
        )
        await local.lose_at("node0", LOSE_AT)
        print(f"bench.nodes: {n} nodes: {hosts.mode}, node0 lost at step {LOSE_AT}", flush=True)
        return await job


def _row(n: int, result: JobResult) -> str:
    by_kind = {o.kind: o for o in result.incidents}
    kill = by_kind.get(FailureKind.PROCESS_EXIT)
    node = by_kind.get(FailureKind.NODE_FAILURE)

    def fig(o: MigrationOutcome | None) -> str:
        if o is None or not o.success or o.recovery_seconds is None:
            return "NOT live" if o else "missing"
        mb = f", {o.proof.bytes / 1e6:.0f} MB in {o.proof.seconds:.2f} s" if o.proof else ""
        return f"{o.recovery_seconds:.2f} s{mb}"

    ratio = (
        f"{node.recovery_seconds / kill.recovery_seconds:.2f}"
        if node and kill and node.recovery_seconds and kill.recovery_seconds
        else "-"
    )
    return f"| {n} | {fig(kill)} | {fig(node)} | {ratio} | {result.steps_recomputed} |"


async def main() -> int:
    env = await start_dev_server()
    results: dict[int, JobResult] = {}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="torchpass-bench-nodes-") as tmp:
        async with env, control_worker(env.client):
            for n in (2, 4):
                results[n] = await one(env.client, Path(tmp) / str(n), n)
    seconds = time.monotonic() - t0
    lines = [
        f"## Node lost whole -> all ranks training again ({datetime.now(UTC):%Y-%m-%d}, `python -m "
        "bench.nodes`)",
        "",
        "N nodes of one rank each and a spare node with one warm spare, ~100 MB of model + Adam "
        "state per",
        f"rank (8 x Linear(1024, 1024)); in each job rank 1 killed at step {KILL_AT}, then node 0 "
        "(rank 0's)",
        f"lost whole at step {LOSE_AT}. Each figure is the incident's own: failure observed -> "
        "training again,",
        f"and the state moved. One invocation, {seconds:.0f} s on this machine.",
        "",
        "| nodes | rank killed | node lost | node / rank | steps recomputed |",
        "|---|---|---|---|---|",
        *(_row(n, r) for n, r in results.items()),
    ]
    print("\n".join(lines))
    write_block("nodes", lines)
    ok = all(
        r.ok and len(r.incidents) == 2 and all(o.success for o in r.incidents)
        for r in results.values()
    )
    return 0 if ok else 1


if __name__ == "__main__":
    exit_process(lambda: asyncio.run(main()))
