"""`torchpass jobs`, `status`, `inject`, `drain`: talk to the jobs running on this host.

Each command but `jobs` (which reads the host's job registrations) sends one request to the job's
coordinator over its control channel and prints the answer; `torchpass run` (`torchpass.cli.run`)
started them.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from torchpass.cli.common import CliError

COMMANDS = ("jobs", "status", "inject", "drain")


def register(sub: Any) -> None:
    sub.add_parser(
        "jobs", help="list this host's jobs: running, and lost (coordinator gone, unfinished)"
    )

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
    i.add_argument(
        "--rank", type=int, default=None, help="the rank to hit (not with donor or receiver)"
    )
    i.add_argument(
        "--after-step", type=int, default=None, help="wait until the rank reaches this step"
    )
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

    d = sub.add_parser(
        "drain", help="planned migration: move a healthy rank off its node (cordon/drain)"
    )
    d.add_argument("--job", required=True)
    d.add_argument("--rank", type=int, required=True)
    d.add_argument("--reason", default="operator request", help="recorded on the incident")
    d.add_argument(
        "--cordon", action="store_true", help="report it as a node cordon rather than a drain"
    )


def run_command(args: argparse.Namespace, settings: Any) -> int:
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
        _print_status(
            _request(settings.state_dir, args.job, wire.StatusRequest(), wire.Status), args.json
        )
        return 0
    if args.command == "inject" and args.spare:
        if args.rank is not None or args.during_transfer or args.after_step is not None:
            raise CliError(
                "--spare hits a spare at once: not with --rank, --after-step or --during-transfer"
            )
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
    print(
        f"torchpass: rank {args.rank} of job {args.job} leaves {reply.detail['node']}: incident "
        "started"
    )
    return 0


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
    """One request to a job's coordinator on this host; its reply (`Ok`, or the type `answer`
    names), or a CliError saying why not."""
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
