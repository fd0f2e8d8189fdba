"""`torchpass run`: launch a training script under the agent, like torchrun, and wait for the job to
end.

Its options say what the job is (`torchpass.job.JobSpec`): ranks, spares, nodes, timeouts,
checkpoints, the contract its incidents count toward. The job runs on this host (its ranks and
spares, or `--nnodes` nodes started here), or with `--remote` on the nodes `torchpass node` starts
on their hosts; its result is printed, with each incident's outcome. The commands that talk to a
running job are `torchpass.cli.job`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any

from torchpass.cli.common import EXIT_JOB_FAILED, CliError, connect, temporal_args


def register(sub: Any) -> None:
    r = sub.add_parser("run", help="launch a training script under the agent, like torchrun")
    r.add_argument(
        "--nproc", type=int, default=None, help="ranks (data-parallel replicas; default 2)"
    )
    r.add_argument("--spares", type=int, default=1, help="warm spare processes (one host)")
    r.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address the coordinator listens on and its ranks and nodes reach it at",
    )
    r.add_argument("--nnodes", type=int, default=0, help="nodes of --nproc-per-node ranks each")
    r.add_argument(
        "--nproc-per-node", type=int, default=None, help="ranks per node (with --nnodes)"
    )
    r.add_argument("--spares-per-node", type=int, default=1, help="warm spares on each node")
    r.add_argument(
        "--spare-nodes",
        type=int,
        default=0,
        help="spare nodes (no ranks, a node's worth of spares): started here, or with --remote "
        "kept by the cluster detector from its spare partition or reservation",
    )
    r.add_argument(
        "--remote",
        action="store_true",
        help="start no node here: print the `torchpass node` command for each host and wait for "
        "them",
    )
    r.add_argument("--job-id", default=None)
    r.add_argument(
        "--hang-timeout",
        type=float,
        default=10.0,
        help="seconds without a heartbeat, or keeping peers waiting in a collective, before a rank "
        "is hung",
    )
    r.add_argument(
        "--collective-timeout", type=float, default=60.0, help="seconds one collective may take"
    )
    r.add_argument(
        "--node-timeout",
        type=float,
        default=5.0,
        help="seconds a node agent may go unheard before its node is lost",
    )
    r.add_argument(
        "--batch-host",
        default=None,
        help="under Slurm, the batch host (the template passes $SLURMD_NODENAME): a failure of "
        "that node ends the whole Slurm job, so it is classified as the brief's node 0 failure",
    )
    r.add_argument(
        "--stripe-donors",
        type=int,
        default=3,
        help="replicas (one per node) a receiving rank takes slices of the state from at once",
    )
    r.add_argument(
        "--checkpoint-every", type=int, default=50, help="steps between fallback checkpoints"
    )
    r.add_argument(
        "--verify-every",
        type=int,
        default=100,
        help="steps between comparisons of the replicas' state digests (and after each recovery); "
        "0: never",
    )
    r.add_argument(
        "--keep-checkpoints", type=int, default=2, help="fallback checkpoints kept (the latest)"
    )
    r.add_argument(
        "--keep-checkpoints-after", action="store_true", help="keep them once the job finished"
    )
    r.add_argument(
        "--enrolment-key-file",
        type=Path,
        default=os.environ.get("TORCHPASS_ENROLMENT_KEY_FILE") or None,
        help="the cluster's enrolment key (private half, 0600): vouches for this job's key to a "
        "contract that names the enrolment key (TORCHPASS_ENROLMENT_KEY_FILE)",
    )
    r.add_argument(
        "--finish-grace",
        type=float,
        default=60.0,
        help="seconds the ranks' code after the training loop may run once training finished",
    )
    r.add_argument(
        "--late-window",
        type=float,
        default=600.0,
        help="seconds an incident stays open after its outcome, taking late evidence (a NotReady) "
        "into it",
    )
    r.add_argument(
        "--control-plane-wait",
        type=float,
        default=5.0,
        help="seconds an incident waits for Temporal before the job recovers by itself (filed "
        "later)",
    )
    r.add_argument(
        "--fresh",
        action="store_true",
        help="start at step 0 even if an earlier run of this --job-id did not finish (by default "
        "it resumes from that run's latest checkpoint)",
    )
    r.add_argument(
        "--no-agent",
        action="store_true",
        help="the script does not use the torchpass agent (an unmodified torchrun script): run it "
        "with torchrun's environment; a failure restarts the whole job, the script loading its own "
        "checkpoint",
    )
    r.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        help="whole-job restarts a --no-agent job gets before it fails",
    )
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    r.add_argument(
        "--customer", help="customer of the YOCO contract the job's incidents count toward"
    )
    r.add_argument("--contract", help="that contract's id (with --customer)")
    r.add_argument("script", type=Path)
    r.add_argument(
        "script_args", nargs=argparse.REMAINDER, help="arguments for the script (after --)"
    )
    temporal_args(r)


async def run(args: argparse.Namespace, settings: Any) -> int:
    from torchpass.job import JobSpec

    script_args = args.script_args[1:] if args.script_args[:1] == ["--"] else args.script_args
    spec_fields: dict[str, Any] = {
        "script": args.script,
        "args": tuple(script_args),
        "nproc": 2 if args.nproc is None else args.nproc,
        "spares": args.spares,
        "host": args.host,
        "state_dir": settings.state_dir,
        "hang_timeout": args.hang_timeout,
        "collective_timeout": args.collective_timeout,
        "node_timeout": args.node_timeout,
        "stripe_donors": args.stripe_donors,
        "batch_host": args.batch_host,
        "spare_nodes": args.spare_nodes if args.remote else 0,  # here, they are this host's own
        "checkpoint_every": args.checkpoint_every,
        "verify_every": args.verify_every,
        "keep_checkpoints": args.keep_checkpoints,
        "keep_checkpoints_after": args.keep_checkpoints_after,
        "enrolment_key_file": args.enrolment_key_file,
        "fresh": args.fresh,
        "seed": args.seed,
        "threads": args.threads,
        "control_plane_wait": args.control_plane_wait,
        "late_window": args.late_window,
        "finish_grace": args.finish_grace,
        "agent": not args.no_agent,
        "max_restarts": args.max_restarts,
    }
    if args.no_agent:
        spec_fields["spares"] = 0  # a whole-job restart has no use for warm spares
    if args.job_id:
        spec_fields["job_id"] = args.job_id
    if args.nnodes:
        if not args.nproc_per_node or args.nproc not in (None, args.nnodes * args.nproc_per_node):
            raise CliError(
                "--nnodes takes --nproc-per-node (the world is their product; leave out --nproc)"
            )
        spec_fields.update(nodes=args.nnodes, nproc=args.nnodes * args.nproc_per_node)
    elif args.remote or args.nproc_per_node:
        raise CliError("--remote and --nproc-per-node go with --nnodes")
    if (args.customer is None) != (args.contract is None):
        raise CliError("--customer and --contract go together")
    if args.contract is not None:
        spec_fields["contract"] = {"customer_id": args.customer, "contract_id": args.contract}
    spec = JobSpec(**spec_fields)
    client = await connect(settings, traced=True)
    from job_agent.coordinator.jobs import JobIdInUse
    from workers.job import run_job

    if spec.nodes:
        from workers.local_nodes import LocalNodes, plan, print_node_command, run_on_local_nodes

        where = "their hosts" if args.remote else "this host"
        print(
            f"torchpass: job {spec.job_id}: {spec.nodes} nodes of {args.nproc_per_node} ranks on "
            f"{where}"
        )
    else:
        print(
            f"torchpass: job {spec.job_id}: {spec.nproc} ranks + {spec.spares} warm spare(s)",
            flush=True,
        )
    no_spare = (
        args.spares_per_node == 0 and args.spare_nodes == 0 if spec.nodes else spec.spares == 0
    )
    if not spec.agent:
        print(
            "torchpass: --no-agent: the script runs as under torchrun; a failure restarts every "
            f"rank (up to --max-restarts {spec.max_restarts}), the script loading its own "
            "checkpoint. With the agent (docs/adopting.md) it would be migrated live",
            file=sys.stderr,
            flush=True,
        )
    elif no_spare and not args.remote:
        print(
            "torchpass: warning: no warm spare: a failure is recovered by a checkpoint restart, "
            'not live (it is recorded as "spare resources not available"); give --spares',
            file=sys.stderr,
            flush=True,
        )
    if spec.enrolment_key_file is not None:
        from workers.job import enrolment_key

        try:
            enrolment_key(spec.enrolment_key_file)
        except (OSError, ValueError) as e:
            raise CliError(str(e)) from None
    try:
        if spec.nodes and not args.remote:
            nodes = plan(
                spec.nodes, args.nproc_per_node, args.spares_per_node, args.spare_nodes, spec.host
            )
            result = await run_on_local_nodes(spec, client, LocalNodes(spec, nodes))
        else:
            told = asyncio.create_task(print_node_command(spec)) if spec.nodes else None
            result = await run_job(spec, client)
            if told is not None:
                told.cancel()
    except JobIdInUse as e:
        raise CliError(f"{e}; pick another --job-id") from None
    print(_summary(result.model_dump(mode="json")), flush=True)
    return 0 if result.ok else EXIT_JOB_FAILED


def _summary(result: dict[str, Any]) -> str:
    lines = [
        f"torchpass: job {result['job_id']} {result['status']} after {result['steps_completed']} "
        "steps"
    ]
    if resumed := result.get("resumed"):
        lines.append(
            f"  resumed at step {resumed['checkpoint_step'] + 1}, from the earlier run's latest "
            f"checkpoint ({resumed['previous']}; its ranks had completed step "
            f"{resumed['last_completed']}): {result['steps_recomputed']} step(s) recomputed in "
            "all, as the ranks reported them"
        )
    for o in result["incidents"]:
        lines.append(
            f"  incident {o['incident_id']}: {o['kind']} -> {o['disposition']}, recovered in "
            f"{o['recovery_seconds'] or 0:.2f} s, {o['steps_recomputed']} steps recomputed"
            + (
                " (by the job itself: the control plane was away)"
                if o.get("handled_locally")
                else ""
            )
        )
        if o["disposition"] != "migrated":
            lines.append(f"    {o['classification']['reason']}")
    if result.get("restarts"):
        lines.append(f"  {result['restarts']} whole-job restart(s)")
    if refuted := result.get("refuted_claims_total"):
        lines.append(
            f"  {refuted} failure claim(s) the job refuted (not its failures; result.json: "
            "refuted_claims)"
        )
    if result.get("incidents_unfiled"):
        lines.append(
            f"torchpass: {result['incidents_unfiled']} incident(s) the job handled itself were "
            "never filed: no incident workflow fetched their record before the job ended (the "
            "control plane unreachable, or each id the job tried held by another's workflow: the "
            "log says which); their records are in the job's local/ directory"
        )
    if result.get("reports_undelivered"):
        lines.append(
            f"torchpass: {result['reports_undelivered']} failure report(s) never reached Temporal"
        )
    if result["error"]:
        lines.append(f"torchpass: {result['error']}")
    return "\n".join(lines)
