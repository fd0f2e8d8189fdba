"""`torchpass run`, `jobs`, `inject`, `drain`: launch a job under the agent and talk to running ones."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

from torchpass.cli.common import EXIT_JOB_FAILED, CliError, connect, temporal_args

COMMANDS = ("run", "jobs", "status", "inject", "drain")


def register(sub: Any) -> None:
    r = sub.add_parser("run", help="launch a training script under the agent, like torchrun")
    r.add_argument("--nproc", type=int, default=None, help="ranks (data-parallel replicas; default 2)")
    r.add_argument("--spares", type=int, default=1, help="warm spare processes (one host)")
    r.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address the coordinator listens on and its ranks and nodes reach it at",
    )
    r.add_argument("--nnodes", type=int, default=0, help="nodes of --nproc-per-node ranks each")
    r.add_argument("--nproc-per-node", type=int, default=None, help="ranks per node (with --nnodes)")
    r.add_argument("--spares-per-node", type=int, default=1, help="warm spares on each node")
    r.add_argument(
        "--spare-nodes",
        type=int,
        default=0,
        help="spare nodes (no ranks, a node's worth of spares): started here, or with --remote kept by the "
        "cluster detector from its spare partition or reservation",
    )
    r.add_argument(
        "--remote",
        action="store_true",
        help="start no node here: print the `torchpass node` command for each host and wait for them",
    )
    r.add_argument("--job-id", default=None)
    r.add_argument(
        "--hang-timeout",
        type=float,
        default=10.0,
        help="seconds without a heartbeat, or keeping peers waiting in a collective, before a rank is hung",
    )
    r.add_argument("--collective-timeout", type=float, default=60.0, help="seconds one collective may take")
    r.add_argument(
        "--node-timeout",
        type=float,
        default=5.0,
        help="seconds a node agent may go unheard before its node is lost",
    )
    r.add_argument(
        "--batch-host",
        default=None,
        help="under Slurm, the batch host (the template passes $SLURMD_NODENAME): a failure of that node "
        "ends the whole Slurm job, so it is classified as the brief's node 0 failure",
    )
    r.add_argument(
        "--stripe-donors",
        type=int,
        default=3,
        help="replicas (one per node) a receiving rank takes slices of the state from at once",
    )
    r.add_argument("--checkpoint-every", type=int, default=50, help="steps between fallback checkpoints")
    r.add_argument(
        "--verify-every",
        type=int,
        default=100,
        help="steps between comparisons of the replicas' state digests (and after each recovery); 0: never",
    )
    r.add_argument("--keep-checkpoints", type=int, default=2, help="fallback checkpoints kept (the latest)")
    r.add_argument("--keep-checkpoints-after", action="store_true", help="keep them once the job finished")
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
        help="seconds an incident stays open after its outcome, taking late evidence (a NotReady) into it",
    )
    r.add_argument(
        "--control-plane-wait",
        type=float,
        default=5.0,
        help="seconds an incident waits for Temporal before the job recovers by itself (filed later)",
    )
    r.add_argument(
        "--fresh",
        action="store_true",
        help="start at step 0 even if an earlier run of this --job-id did not finish (by default it resumes "
        "from that run's latest checkpoint)",
    )
    r.add_argument(
        "--no-agent",
        action="store_true",
        help="the script does not use the torchpass agent (an unmodified torchrun script): run it with "
        "torchrun's environment; a failure restarts the whole job, the script loading its own checkpoint",
    )
    r.add_argument(
        "--max-restarts", type=int, default=3, help="whole-job restarts a --no-agent job gets before it fails"
    )
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    r.add_argument("--customer", help="customer of the YOCO contract the job's incidents count toward")
    r.add_argument("--contract", help="that contract's id (with --customer)")
    r.add_argument("script", type=Path)
    r.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script (after --)")
    temporal_args(r)

    sub.add_parser("jobs", help="list this host's jobs: running, and lost (coordinator gone, unfinished)")

    s = sub.add_parser(
        "status", help="a running job's ranks: where each runs (node, local rank, pid), its step"
    )
    s.add_argument("--job", required=True)
    s.add_argument("--json", action="store_true", help="the coordinator's whole answer, as JSON")

    i = sub.add_parser("inject", help="inject a failure into a running job (tests, demos, chaos)")
    i.add_argument(
        "action", choices=["kill", "hang", "pause"], help="pause: SIGSTOP, SIGCONT after --seconds"
    )
    i.add_argument("--job", required=True)
    i.add_argument("--rank", type=int, default=None, help="the rank to hit (not with donor or receiver)")
    i.add_argument("--after-step", type=int, default=None, help="wait until the rank reaches this step")
    i.add_argument(
        "--during-transfer",
        choices=["rank", "donor", "receiver"],
        default=None,
        help="fire when the next state transfer starts, at --rank, the donor or the first receiver",
    )
    i.add_argument(
        "--spare",
        action="store_true",
        help="hit a spare now (one still starting if any, else a warm one) instead of a rank",
    )
    i.add_argument("--seconds", type=float, default=5.0, help="how long a pause lasts")

    d = sub.add_parser("drain", help="planned migration: move a healthy rank off its node (cordon/drain)")
    d.add_argument("--job", required=True)
    d.add_argument("--rank", type=int, required=True)
    d.add_argument("--reason", default="operator request", help="recorded on the incident")
    d.add_argument("--cordon", action="store_true", help="report it as a node cordon rather than a drain")


def run_command(args: argparse.Namespace, settings: Any) -> int:
    if args.command == "run":
        return asyncio.run(_run(args, settings))
    if args.command == "jobs":
        from job_agent.coordinator.jobs import registered_jobs

        for j in registered_jobs(settings.state_dir):
            state = "running" if j["alive"] else "lost (torchpass run --job-id it again to resume)"
            print(
                f"{j['job_id']}\t{state}\tworld {j['world_size']}\tcoordinator pid {j['pid']}"
                f"\tsince {j['started_at']}"
            )
        return 0
    from job_agent import wire

    if args.command == "status":
        _print_status(_request(settings.state_dir, args.job, wire.StatusRequest(), wire.Status), args.json)
        return 0
    if args.command == "inject" and args.spare:
        if args.rank is not None or args.during_transfer or args.after_step is not None:
            raise CliError("--spare hits a spare at once: not with --rank, --after-step or --during-transfer")
        frame = wire.Inject(action=args.action, slot=0, seconds=args.seconds, target="spare")
        reply = _request(settings.state_dir, args.job, frame)
        was, agent = reply.detail["was"], reply.detail["agent"]
        print(f"torchpass: {args.action} of {was} spare {agent} in job {args.job}")
        return 0
    if args.command == "inject":
        target = args.during_transfer
        if (args.rank is None) != (target in ("donor", "receiver")):
            raise CliError("give --rank, or --during-transfer donor|receiver without it")
        inject = wire.Inject(
            action=args.action,
            slot=args.rank or 0,
            after_step=args.after_step,
            seconds=args.seconds,
            during="transfer" if target else "step",
            target=target or "rank",
        )
        _request(settings.state_dir, args.job, inject)
        who = f"the {target}" if target in ("donor", "receiver") else f"rank {args.rank}"
        if target:
            when = " when the next state transfer starts"
        else:
            when = f" at step {args.after_step}" if args.after_step is not None else " now"
        print(f"torchpass: {args.action} of {who} in job {args.job} scheduled{when}")
        return 0
    kind = "cordon" if args.cordon else "drain"
    drain = wire.Drain(slot=args.rank, reason=args.reason, kind=kind)
    reply = _request(settings.state_dir, args.job, drain)
    print(f"torchpass: rank {args.rank} of job {args.job} leaves {reply.detail['node']}: incident started")
    return 0


async def _run(args: argparse.Namespace, settings: Any) -> int:
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
            raise CliError("--nnodes takes --nproc-per-node (the world is their product; leave out --nproc)")
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
        print(f"torchpass: job {spec.job_id}: {spec.nodes} nodes of {args.nproc_per_node} ranks on {where}")
    else:
        print(f"torchpass: job {spec.job_id}: {spec.nproc} ranks + {spec.spares} warm spare(s)", flush=True)
    no_spare = args.spares_per_node == 0 and args.spare_nodes == 0 if spec.nodes else spec.spares == 0
    if not spec.agent:
        print(
            "torchpass: --no-agent: the script runs as under torchrun; a failure restarts every rank (up to"
            f" --max-restarts {spec.max_restarts}), the script loading its own checkpoint. With the agent"
            " (docs/adopting.md) it would be migrated live",
            file=sys.stderr,
            flush=True,
        )
    elif no_spare and not args.remote:
        print(
            "torchpass: warning: no warm spare: a failure is recovered by a checkpoint restart, not live"
            ' (it is recorded as "spare resources not available"); give --spares',
            file=sys.stderr,
            flush=True,
        )
    try:
        if spec.nodes and not args.remote:
            nodes = plan(spec.nodes, args.nproc_per_node, args.spares_per_node, args.spare_nodes, spec.host)
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
    lines = [f"torchpass: job {result['job_id']} {result['status']} after {result['steps_completed']} steps"]
    if resumed := result.get("resumed"):
        lines.append(
            f"  resumed at step {resumed['checkpoint_step'] + 1}, from the earlier run's latest checkpoint "
            f"({resumed['previous']}; its ranks had completed step {resumed['last_completed']}): "
            f"{result['steps_recomputed']} step(s) recomputed in all, as the ranks reported them"
        )
    for o in result["incidents"]:
        lines.append(
            f"  incident {o['incident_id']}: {o['kind']} -> {o['disposition']}, "
            f"recovered in {o['recovery_seconds'] or 0:.2f} s, {o['steps_recomputed']} steps recomputed"
            + (" (by the job itself: the control plane was away)" if o.get("handled_locally") else "")
        )
        if o["disposition"] != "migrated":
            lines.append(f"    {o['classification']['reason']}")
    if result.get("restarts"):
        lines.append(f"  {result['restarts']} whole-job restart(s)")
    if result.get("incidents_unfiled"):
        lines.append(
            f"torchpass: {result['incidents_unfiled']} incident(s) the job handled itself were never filed "
            "(Temporal did not come back in time); their records are in the job's local/ directory"
        )
    if result.get("reports_undelivered"):
        lines.append(f"torchpass: {result['reports_undelivered']} failure report(s) never reached Temporal")
    if result["error"]:
        lines.append(f"torchpass: {result['error']}")
    return "\n".join(lines)


def _print_status(st: Any, as_json: bool) -> None:
    if as_json:
        print(st.model_dump_json(indent=2))
        return
    now = f", in incident {st.incident}" if st.incident else ""
    print(
        f"job {st.job_id}: {st.state}, generation {st.generation}, {st.world_size} ranks, "
        f"{st.spares} warm spare(s), {st.incidents} incident(s) recorded{now}"
    )
    print("slot\tstate\tstep\tnode\tlocal_rank\tpid\tagent")
    for r in sorted(st.ranks, key=lambda r: r.slot):
        print(f"{r.slot}\t{r.state}\t{r.step}\t{r.node}\t{r.device}\t{r.pid}\t{r.agent}")
    if st.idle_nodes:
        print("idle nodes (spare): " + ", ".join(st.idle_nodes))


def _request(state_dir: Path, job: str, frame: Any, answer: Any = None) -> Any:
    """One request to a job's coordinator on this host; its reply (`Ok`, or the type `answer` names), or a
    CliError saying why not."""
    from job_agent import wire
    from job_agent.coordinator.jobs import UnknownJob, request
    from job_agent.wire.protocol import ProtocolError

    try:
        reply = request(state_dir, job, frame)
    except UnknownJob as e:
        raise CliError(str(e)) from None
    except (OSError, ProtocolError) as e:
        raise CliError(f"cannot reach the coordinator of job {job}: {e}") from None
    if isinstance(reply, wire.Error):
        raise CliError(reply.reason)
    if not isinstance(reply, answer or wire.Ok):
        raise CliError(f"unexpected answer from the coordinator of job {job}: {reply.t}")
    return reply
