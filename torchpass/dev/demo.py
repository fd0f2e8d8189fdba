"""`make demo`: a 4-rank job on two nodes loses a rank to SIGKILL, then another to a hang, then a
whole node; all three are live-migrated.

Everything is real: the embedded Temporal dev server with its web UI, the control worker, the job's
coordinator and worker, three node agents (`torchpass node`: two of two ranks and a warm spare each,
and a spare node with two warm spares), each on a host of its own where this machine can make
network namespaces (else on a loopback address of its own), and torch.distributed processes (gloo on
CPU). The killed and the hung rank are each replaced by the spare on their own node; the node lost
(the one holding rank 0) is replaced by the spare node. The job belongs to a YOCO contract: it is
opted in and its environment validated before the failures, and the incidents are recorded on the
contract, whose standing is printed at the end. The final state is compared with an uninterrupted
reference run of the same job on one host. Exit 0 only if every failure was migrated live, no
completed step was recomputed, the states are bitwise equal and the contract counted every
migration. `--keep` leaves the server running afterwards, for the web UI and `torchpass contract
show`.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

from temporalio.client import Client

from job_agent import wire
from job_agent.coordinator.jobs import request, wait_until_ready
from job_agent.launch.launcher import free_port
from torchpass.contract.queries import Standing
from torchpass.contract.terms import DEVELOPMENT_BANNER
from torchpass.dev.hosts import Fabric, fabric
from torchpass.dev.server import start_dev_server
from torchpass.job import JobResult, JobSpec
from torchpass.models import ContractRef
from torchpass.render import format_check, format_ledger, format_outcome, format_standing
from workers import contract_client as cc
from workers.control import control_worker
from workers.job import run_job
from workers.local_nodes import LocalNode, LocalNodes, run_on_local_nodes
from workers.settings import Settings
from workers.temporal import exit_process

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_dp.py"
STEPS = 220
INJECT = (("kill", 1, 40), ("hang", 2, 100))
NODE_LOSS = ("node0", 160)  # the node holding ranks 0 and 1, lost whole at this step
FAILURES = len(INJECT) + 1
CONTRACT = ContractRef(customer_id="demo-customer", contract_id="demo-contract")
JOB = "demo-migrate"


def _spec(
    state_dir: Path, job_id: str, spares: int, contract: ContractRef | None = None, **kw: object
) -> JobSpec:
    return JobSpec.model_validate(
        dict(
            contract=contract,
            job_id=job_id,
            script=SCRIPT,
            args=("--steps", str(STEPS), "--width", "512", "--depth", "4"),
            nproc=4,
            spares=spares,
            state_dir=state_dir,
            hang_timeout=1.5,
            checkpoint_every=50,
            **kw,
        )
    )


async def _open_contract(client: Client) -> None:
    # The demo's host has no scheduler, so its check is waived: only a development contract accepts
    # that.
    await cc.open_development_contract(client, CONTRACT, JOB, "120000.00")
    print(f"demo: contract {CONTRACT.contract_id} created, job {JOB} opted in", flush=True)
    print(f"demo: {DEVELOPMENT_BANNER}", flush=True)


async def _validate(client: Client) -> bool:
    report = await cc.validate_job(client, CONTRACT.customer_id, CONTRACT.contract_id, JOB)
    for c in report.checks:
        print(f"demo:   {format_check(c)}", flush=True)
    covered = (
        JOB
        in (await cc.get_standing(client, CONTRACT.customer_id, CONTRACT.contract_id)).covered_jobs
    )
    waived = f" ({', '.join(report.waived)} waived)" if report.waived else ""
    verdict = f"validated{waived}: job covered" if covered else "NOT validated"
    print(f"demo: environment {verdict}", flush=True)
    return covered


async def _inject(state_dir: Path, job_id: str) -> None:
    for action, rank, step in INJECT:
        inject = wire.Inject(action=wire.InjectAction(action), slot=rank, after_step=step)
        reply = await asyncio.to_thread(request, state_dir, job_id, inject)
        print(f"demo: scheduled {action} of rank {rank} at step {step}: {reply.t}", flush=True)


def _verdict(result: JobResult, reference: JobResult, ui: str, standing: Standing) -> bool:
    ok = True
    print("\n=== incidents ===")
    for o in result.incidents:
        print(format_outcome(o))
        wf_id = quote(o.incident_id.rpartition("/")[0], safe="")
        print(f"UI         {ui}/namespaces/default/workflows/{wf_id}\n")
        resumed = set(o.resumed_steps.values())
        # Measured, not assumed: the ranks' own step reports say where each one resumed.
        live = o.step_before is not None and resumed == {o.step_before + 1}
        ok &= o.success and o.steps_recomputed == 0 and live
    if len(result.incidents) != FAILURES:
        print(f"demo: expected {FAILURES} incidents, got {len(result.incidents)}")
        ok = False
    measured = [o.steps_recomputed for o in result.incidents]
    print("=== steps recomputed ===")
    print(f"per incident (from the ranks' step reports)     {measured}")
    print(f"whole job (the coordinator's independent count) {result.steps_recomputed}")
    ok &= result.steps_recomputed == 0
    same = result.final_digest is not None and result.final_digest == reference.final_digest
    print("=== final state ===")
    print(f"reference run   {reference.final_digest}")
    print(f"migrated run    {result.final_digest}")
    print("bitwise identical" if same else "DIFFERENT from the reference")
    print("=== YOCO contract ===")
    print(format_standing(standing))
    counted = standing.qualifying == FAILURES and standing.successful == FAILURES
    if not counted:
        print(f"demo: the contract should count {FAILURES} successful qualifying migrations")
    return ok and same and counted and result.ok and reference.ok


def _nodes(hosts: Fabric) -> list[LocalNode]:
    a, b, s = hosts.hosts
    return [
        LocalNode("spare0", 0, 2, s.address, s.prefix),
        LocalNode("node0", 2, 1, a.address, a.prefix),
        LocalNode("node1", 2, 1, b.address, b.prefix),
    ]


async def _migrated_run(client: Client, state_dir: Path) -> tuple[JobResult, bool]:
    await _open_contract(client)
    with fabric(3) as hosts:
        print(
            f"demo: hosts of the job's nodes: {hosts.mode} "
            f"({', '.join(h.address for h in hosts.hosts)})"
        )
        spec = _spec(state_dir, JOB, spares=0, contract=CONTRACT, nodes=2, host=hosts.coordinator)
        nodes = LocalNodes(spec, _nodes(hosts))
        job = asyncio.create_task(run_on_local_nodes(spec, client, nodes))
        try:
            await asyncio.to_thread(wait_until_ready, state_dir, JOB)
            validated = await _validate(client)
            await _inject(state_dir, JOB)
            name, step = NODE_LOSS
            await nodes.lose_at(name, step)
            print(
                f"demo: node {name} lost whole at step {step} (its agent and its ranks killed)",
                flush=True,
            )
        except BaseException:
            job.cancel()
            raise
        return await job, validated


async def _standing(client: Client) -> Standing:
    """The contract's standing once both outcomes arrived (their signals are asynchronous)."""
    for _ in range(50):
        st = await cc.get_standing(client, CONTRACT.customer_id, CONTRACT.contract_id)
        if st.qualifying + sum(st.excluded.values()) >= FAILURES:
            return st
        await asyncio.sleep(0.1)
    return st


async def _audit(address: str) -> bool:
    """`torchpass audit` as an auditor runs it: the ledger recomputed from the histories alone."""
    argv = ["audit", "--customer", CONTRACT.customer_id, "--contract", CONTRACT.contract_id]
    print(f"\ndemo: torchpass {' '.join(argv)}", flush=True)
    cmd = [sys.executable, "-m", "torchpass.cli", *argv, "--address", address]
    proc = await asyncio.create_subprocess_exec(*cmd)
    return await asyncio.wait_for(proc.wait(), 120) == 0


async def main() -> int:
    keep = "--keep" in sys.argv[1:]
    ui_port = free_port("127.0.0.1")
    env = await start_dev_server(ui_port)
    ui = f"http://127.0.0.1:{ui_port}"
    address = env.client.service_client.config.target_host
    print(f"demo: Temporal dev server up at {address}, web UI at {ui}", flush=True)
    # This host runs neither Slurm nor Kubernetes: the demo's worker waives that one check, and says
    # so.
    waive = Settings.load(validation={"allow_local": True})
    with tempfile.TemporaryDirectory(prefix="torchpass-demo-") as tmp:
        state_dir = Path(tmp)
        async with env, control_worker(env.client, waive):
            t0 = time.monotonic()
            reference = await run_job(_spec(state_dir, "demo-reference", spares=0), env.client)
            print(
                f"demo: reference run {reference.status} in {time.monotonic() - t0:.1f} s",
                flush=True,
            )
            t0 = time.monotonic()
            result, validated = await _migrated_run(env.client, state_dir)
            print(
                f"demo: migrated run {result.status} in {time.monotonic() - t0:.1f} s", flush=True
            )
            standing = await _standing(env.client)
            ok = _verdict(result, reference, ui, standing) and validated
            page = await cc.get_ledger(env.client, CONTRACT.customer_id, CONTRACT.contract_id)
            print(format_ledger(page))
            ok = await _audit(address) and ok
            print("\ndemo: PASS" if ok else "\ndemo: FAIL", flush=True)
            if keep:
                show = f"--customer {CONTRACT.customer_id} --contract {CONTRACT.contract_id}"
                print(f"demo: server kept at {address} (Ctrl-C to stop); try", flush=True)
                print(f"  torchpass contract show {show} --address {address}", flush=True)
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.Event().wait()
    return 0 if ok else 1


def _run() -> int:
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C ends a `--keep` demo
        return asyncio.run(main())
    return 0


if __name__ == "__main__":
    exit_process(_run)
