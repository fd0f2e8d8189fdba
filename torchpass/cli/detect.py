"""`torchpass detect kubernetes|slurm`: a cluster detector, telling the jobs under the state
directory what happens to their nodes (`workers.detectors.kube`, `workers.detectors.slurm`). It runs
until SIGTERM or Ctrl-C."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from pathlib import Path
from typing import Any

from torchpass.cli.common import CliError


def register(sub: Any) -> None:
    d = sub.add_parser(
        "detect",
        help="watch the cluster (Kubernetes or Slurm) and tell running jobs what happens to their "
        "nodes",
        description="One per cluster, beside the control worker. It needs the state directory the "
        "jobs register in (TORCHPASS_STATE_DIR: a shared volume where the jobs run on other "
        "hosts).",
    )
    d.add_argument("scheduler", choices=("kubernetes", "slurm"))
    d.add_argument(
        "--kubeconfig", type=Path, help="kubernetes: a kubeconfig file (default: in-cluster config)"
    )
    d.add_argument("--namespace", default="torchpass", help="kubernetes: where the jobs' pods run")
    d.add_argument(
        "--job-label", default="torchpass.io/job", help="kubernetes: the label naming a pod's job"
    )
    d.add_argument(
        "--spare-node-label",
        default=None,
        help="kubernetes: keep the jobs' spare nodes (--spare-nodes) on Nodes of this label "
        "selector, each a Pod from the job's spare-node PodTemplate (e.g. "
        "torchpass.io/spare-node=true)",
    )
    d.add_argument(
        "--resync", type=float, default=60.0, help="seconds between full reads of the cluster"
    )
    d.add_argument(
        "--poll", type=float, default=5.0, help="slurm: seconds between reads of the nodes' states"
    )
    d.add_argument("--partition", default=None, help="slurm: only the nodes of this partition")
    d.add_argument(
        "--spare-partition",
        default=None,
        help="slurm: the partition spare nodes come from (--spare-nodes)",
    )
    d.add_argument(
        "--spare-reservation", default=None, help="slurm: the reservation spare nodes come from"
    )
    d.add_argument(
        "--node-command",
        default="torchpass",
        help="slurm: how a spare node runs torchpass "
        "(e.g. '/opt/venv/bin/python -m torchpass.cli')",
    )
    d.add_argument(
        "--node-host-command",
        default="hostname -i",
        help="slurm: prints a spare node's address, reachable from the job's other nodes",
    )


def run(args: argparse.Namespace, settings: Any) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from workers.detectors.reports import Jobs

    if args.scheduler == "kubernetes":
        detector: Any = _kube(args, Jobs(settings.state_dir, "kubernetes"))
    else:
        from workers.detectors.slurm import SlurmDetector, SlurmSettings

        slurm = SlurmSettings(poll_seconds=args.poll, partition=args.partition)
        detector = SlurmDetector(
            Jobs(settings.state_dir, "slurm"), slurm, _spares(args, settings.state_dir)
        )
    done = threading.Event()

    def stop(signum: int, frame: object) -> None:
        detector.close()
        done.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    worker = threading.Thread(target=detector.run, name="torchpass-detect", daemon=True)
    worker.start()
    while worker.is_alive() and not done.wait(0.5):
        pass
    return 0


def _spares(args: argparse.Namespace, state_dir: Path) -> Any:
    """The keeper of the jobs' spare nodes (`slurm_spares.py`), with a place to take them from."""
    if args.spare_partition is None and args.spare_reservation is None:
        return None
    from pydantic import ValidationError

    from workers.detectors.slurm_spares import SlurmSpares, SpareNodeSettings

    try:
        spares = SpareNodeSettings(
            partition=args.spare_partition,
            reservation=args.spare_reservation,
            node_command=args.node_command,
            host_command=args.node_host_command,
        )
    except ValidationError as e:
        raise CliError(f"spare nodes: {e}") from None
    return SlurmSpares(state_dir, spares).keep


def _kube(args: argparse.Namespace, jobs: Any) -> Any:
    from kubernetes import client, config

    from workers.detectors.kube import KubeDetector, KubeSettings

    try:
        if args.kubeconfig is not None:
            config.load_kube_config(config_file=str(args.kubeconfig))
        else:
            config.load_incluster_config()
    except (config.ConfigException, OSError) as e:
        raise CliError(f"no Kubernetes API to watch: {e}") from None
    settings = KubeSettings(
        namespace=args.namespace, job_label=args.job_label, resync_seconds=args.resync
    )
    api = client.CoreV1Api()
    keep = None
    if args.spare_node_label:
        from workers.detectors.kube_spares import KubeSpares

        keep = KubeSpares(api, jobs.state_dir, settings, args.spare_node_label).keep
    return KubeDetector(api, jobs, settings, keep)
