"""slurm.conf for the real test cluster: several slurmd on one host, everything under one directory.

Each setting has its reason beside it; see tests/slurm/cluster.py for the daemons that read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SlurmConfig:
    """What varies between test clusters: names, the directory (`base`), ports, nodes and hooks."""

    cluster: str
    host: str
    base: Path
    ctld_port: int
    partitions: dict[str, list[str]]
    node_ports: dict[str, int]
    cpus: int
    real_memory_mb: int
    prolog: Path | None
    epilog: Path | None
    prolog_flags: str | None


def render_config(c: SlurmConfig) -> str:
    """slurm.conf for several slurmd on one host, everything under `c.base`, nothing on 0.0.0.0."""
    b = c.base
    lines = [
        # Unique per cluster: it names the state files, and slurmctld refuses state from another
        # cluster.
        f"ClusterName={c.cluster}",
        # slurmctld runs only where its short hostname matches; clients and slurmd reach it at
        # 127.0.0.1.
        f"SlurmctldHost={c.host}(127.0.0.1)",
        f"SlurmctldPort={c.ctld_port}",
        # Bind slurmctld, slurmd and srun to the node address (127.0.0.1), never to every interface.
        "CommunicationParameters=NoInAddrAny,NoCtldInAddrAny",
        # Everything runs as root: slurmd must, to start job steps.
        "SlurmUser=root",
        "SlurmdUser=root",
        # The private munged (own key and socket), for both RPC authentication and job credentials.
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={b}/munge/munge.socket",
        # All state under `base`; %n gives each slurmd (one per node name, one host) its own files.
        f"StateSaveLocation={b}/state",
        f"SlurmdSpoolDir={b}/spool/%n",
        f"SlurmctldPidFile={b}/run/slurmctld.pid",
        f"SlurmdPidFile={b}/run/slurmd-%n.pid",
        f"SlurmctldLogFile={b}/log/slurmctld.log",
        f"SlurmdLogFile={b}/log/slurmd-%n.log",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        # No cgroups: track a job's processes by parent pid; bind no tasks to CPUs (nodes claim more
        # CPUs than the host has, and several nodes share them).
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        # No slurmdbd, no accounting, no PMIx (srun starts plain processes).
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "MpiDefault=none",
        "SwitchType=switch/none",
        # Steps do not inherit the submitting shell's ulimits; no mail.
        "PropagateResourceLimits=NONE",
        "MailProg=/bin/true",
        # Nodes claim the CPUs and memory written below, whatever the host has.
        "SlurmdParameters=config_overrides",
        # Jobs share nodes CPU by CPU; memory is not a consumable.
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "SchedulerType=sched/backfill",
        # sbatch jobs start at the scheduler's next 1 s tick instead of waiting up to 3 s.
        "SchedulerParameters=batch_sched_delay=0",
        # Only a node DOWN for not responding comes back by itself (2 would also undo `scontrol ...
        # down` as soon as that node's slurmd re-registers, e.g. after the killed job's epilog).
        "ReturnToService=1",
        # 2 s between SIGTERM and SIGKILL on cancel; finished jobs stay in `scontrol show job` for
        # 60 s.
        "KillWait=2",
        "MinJobAge=60",
        "InactiveLimit=0",
    ]
    if c.prolog is not None:
        lines.append(f"Prolog={c.prolog}")
    if c.epilog is not None:
        lines.append(f"Epilog={c.epilog}")
    if c.prolog is not None and c.prolog_flags:
        # Alloc: run the prolog on every allocated node when the job starts; without it the prolog
        # runs on the batch host at start and on the other nodes only at their first srun step.
        # (Contain would need proctrack/cgroup.)
        lines.append(f"PrologFlags={c.prolog_flags}")
    for node, port in c.node_ports.items():
        lines.append(
            f"NodeName={node} NodeHostname={c.host} NodeAddr=127.0.0.1 Port={port} "
            f"CPUs={c.cpus} RealMemory={c.real_memory_mb} State=UNKNOWN"
        )
    for i, (name, members) in enumerate(c.partitions.items()):
        default = "YES" if i == 0 else "NO"
        lines.append(
            f"PartitionName={name} Nodes={','.join(members)} Default={default} MaxTime=INFINITE "
            "State=UP"
        )
    return "\n".join(lines) + "\n"
