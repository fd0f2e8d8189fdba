"""The DDP training of `examples/torchrun_ddp.py`, written for torchft 0.2.0 instead of torchrun, so
that `bench/torchft_peer.py` can measure torchft's recovery from a killed replica on the same work.

It follows the layout of torchft's own `train_ddp.py` example (pytorch/torchft, top of the
repository): a `Manager` over a reconfigurable `ProcessGroupGloo`, given callbacks that save and
load the model and optimizer state so that a (re)joining replica group heals from a live peer; the
model wrapped in torchft's `DistributedDataParallel`, AdamW wrapped in torchft's `Optimizer` (whose
`zero_grad` starts the quorum and whose `step` applies the update only when the manager says the
step commits); and torchft's `DistributedSampler` sharding the data by replica group. Training is
counted in the manager's committed steps rather than in epochs.

Here each replica group is one process (groups of 1 rank, 4 groups). It is started without torchrun,
so it hosts its group's TCPStore itself (the store torchrun's agent would otherwise host at
MASTER_ADDR:MASTER_PORT). Environment, as torchft documents it: REPLICA_GROUP_ID,
NUM_REPLICA_GROUPS, TORCHFT_LIGHTHOUSE, MASTER_ADDR, MASTER_PORT, RANK=0, WORLD_SIZE=1. Timeouts
left unset keep torchft's defaults.

Model and data are those of `examples/torchrun_ddp.py`: `--width` x `--depth` Linear + GELU layers
and a Linear(width, 1) head built after torch.manual_seed(0), AdamW lr 1e-3, the sin(x.sum())
regression set from Generator seed 7, sampler seed 3, drop_last. `--step-log` gets `rank step pid
unix-time begin|end` lines as in that script, with rank = the replica group and step =
manager.current_step() when the step begins; "end" is written only for a step the manager committed.
A process that has not yet been in a quorum (a fresh or replacement one) logs its first step as step
0: its real step is known only after it has healed.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed import TCPStore
from torch.utils.data import DataLoader, TensorDataset
from torchft import (
    DistributedDataParallel,
    DistributedSampler,
    Manager,
    Optimizer,
    ProcessGroupGloo,
)


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--depth", type=int, default=1, help="hidden Linear(width, width) layers")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--samples", type=int, default=2048)
    p.add_argument("--min-replicas", type=int, default=1, help="Manager min_replica_size")
    p.add_argument(
        "--step-log", help="append 'rank step pid unix-time begin|end' for each step (benchmarks)"
    )
    p.add_argument(
        "--hold-at-step",
        type=int,
        help="(benchmarks) after logging 'begin' of this step, wait there before touching torchft, "
        "to be killed",
    )
    # torchft settings; unset = torchft's default
    p.add_argument(
        "--timeout-s", type=float, help="Manager timeout (collectives, should_commit, healing)"
    )
    p.add_argument("--quorum-timeout-s", type=float, help="Manager quorum_timeout")
    p.add_argument("--connect-timeout-s", type=float, help="Manager connect_timeout")
    p.add_argument(
        "--heartbeat-ms", type=int, help="Manager heartbeat_interval (to the lighthouse)"
    )
    p.add_argument("--pg-timeout-s", type=float, help="ProcessGroupGloo timeout")
    return p.parse_args()


def _manager_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The Manager keyword arguments given on the command line; torchft's defaults for the rest."""
    kw: dict[str, Any] = {}
    for name, value in (
        ("timeout", args.timeout_s),
        ("quorum_timeout", args.quorum_timeout_s),
        ("connect_timeout", args.connect_timeout_s),
    ):
        if value is not None:
            kw[name] = timedelta(seconds=value)
    if args.heartbeat_ms is not None:
        kw["heartbeat_interval"] = timedelta(milliseconds=args.heartbeat_ms)
    return kw


def main() -> None:
    args = _args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    group = int(os.environ["REPLICA_GROUP_ID"])
    groups = int(os.environ["NUM_REPLICA_GROUPS"])
    # Kept alive: the Manager and the quorum's process group connect to it.
    store = TCPStore(  # noqa: F841
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=True,
        wait_for_workers=False,
    )

    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(args.depth):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.GELU()]
    net = torch.nn.Sequential(*layers, torch.nn.Linear(args.width, 1))
    adamw = torch.optim.AdamW(net.parameters(), lr=1e-3)

    g = torch.Generator().manual_seed(7)
    x = torch.randn(args.samples, args.width, generator=g)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True).sin())
    sampler = DistributedSampler(
        data,
        replica_rank=group,
        num_replica_groups=groups,
        group_rank=0,
        num_replicas=1,
        seed=3,
        drop_last=True,
    )
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler, drop_last=True)

    def state_dict() -> dict[str, Any]:
        return {"model": net.state_dict(), "optim": adamw.state_dict()}

    def load_state_dict(sd: dict[str, Any]) -> None:
        net.load_state_dict(sd["model"])
        adamw.load_state_dict(sd["optim"])

    pg_kw = {} if args.pg_timeout_s is None else {"timeout": timedelta(seconds=args.pg_timeout_s)}
    manager = Manager(
        pg=ProcessGroupGloo(**pg_kw),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=args.min_replicas,
        replica_id=f"torchft_ddp_{group}",
        hostname="127.0.0.1",
        **_manager_settings(args),
    )
    model = DistributedDataParallel(manager, net)
    opt = Optimizer(manager, adamw)
    committed: list[bool] = []
    # runs only when the step commits
    adamw.register_step_post_hook(lambda *_: committed.append(True))

    epoch = 0
    while manager.current_step() < args.steps:
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            step = manager.current_step()
            if step >= args.steps:
                break
            _log(args.step_log, group, step, "begin")
            if step == args.hold_at_step:
                # the benchmark SIGKILLs this process here, before the step's quorum request
                time.sleep(60)
            committed.clear()
            # starts this step's quorum (healing, if behind, happens in the background)
            opt.zero_grad()
            F.mse_loss(model(xb), yb).backward()  # gradients allreduced across the quorum
            opt.step()  # applied only if every replica group in the quorum commits
            if committed:
                _log(args.step_log, group, step, "end")
        epoch += 1
    manager.shutdown()


def _log(path: str | None, rank: int, step: int, event: str) -> None:
    if path:
        with open(path, "a") as log:
            log.write(f"{rank} {step} {os.getpid()} {time.time():.6f} {event}\n")


if __name__ == "__main__":
    main()
