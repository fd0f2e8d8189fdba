"""A stock `DistributedDataParallel` script: the model wrapped as usual, a `DataLoader` over a
default `DistributedSampler`, a cosine LR schedule, and gradient accumulation with `no_sync()`. Each
rank seeds its own initial weights differently, as many scripts do, and relies on DDP to start every
replica from rank 0's. The lines marked `torchpass` are all it takes; the README shows the diff
against the same script under torchrun.

Run it with `torchpass run --nproc 4 --spares 1 examples/train_ddp.py -- --steps 200`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import time

import torch
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from job_agent import RankAgent  # torchpass


def dataset(n: int, width: int) -> TensorDataset:
    g = torch.Generator().manual_seed(7)  # the same data on every rank
    x = torch.randn(n, width, generator=g)
    return TensorDataset(x, x.sum(dim=1, keepdim=True).sin())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument(
        "--accum", type=int, default=2, help="micro-batches a step (no_sync but the last)"
    )
    p.add_argument("--samples", type=int, default=2048)
    p.add_argument("--bucket-mb", type=float, default=0.05)
    p.add_argument("--compile", action="store_true", help="torch.compile the DDP-wrapped model")
    p.add_argument("--comm-hook", choices=["fp16", "powersgd"], help="DDP communication hook")
    p.add_argument(
        "--noise", type=float, default=0.0, help="input noise from the script's own generator"
    )
    p.add_argument(
        "--noise-untracked", action="store_true", help="leave that generator untracked (tests)"
    )
    p.add_argument(
        "--step-log", help="append 'rank step pid unix-time begin|end' for each step (benchmarks)"
    )
    args = p.parse_args()

    agent = RankAgent()  # torchpass: in place of dist.init_process_group()
    # each rank its own initial weights: DDP starts them from rank 0's
    torch.manual_seed(100 + agent.rank)
    layers: list[torch.nn.Module] = []
    for _ in range(args.depth):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(args.width, 1)).to(agent.device)
    model = DDP(model, bucket_cap_mb=args.bucket_mb)  # several buckets even for a small model
    # stateless (state=None): it reduces over whatever the default group is
    if args.comm_hook == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif args.comm_hook == "powersgd":  # stateful: refused by the agent, with the reason
        model.register_comm_hook(powerSGD.PowerSGDState(process_group=None), powerSGD.powerSGD_hook)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if args.compile:  # as PyTorch's DDP notes show: compile the wrapper; the agent finds DDP inside
        model = torch.compile(model)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    loader = DataLoader(
        dataset(args.samples, args.width),
        batch_size=args.batch,
        sampler=DistributedSampler(dataset(args.samples, args.width)),
        drop_last=True,
    )
    noise = torch.Generator().manual_seed(5)  # a random stream the script keeps of its own
    extras = {} if args.noise_untracked else {"noise": noise}
    agent.track(model, opt, sched=sched, **extras)  # torchpass

    for step in agent.steps(args.steps, data=loader):  # torchpass: `for x, y in loader:` before
        with step:  # torchpass: a peer lost in here -> this step is done again, same batch
            _log(args.step_log, agent.rank, step.k, "begin")
            x, y = (t.to(agent.device) for t in step.batch)
            # augmentation: noise from the script's generator, a flip from Python's `random`
            if args.noise:
                x = x + args.noise * torch.randn(x.shape, generator=noise).to(agent.device)
                x = x.flip(0) if random.random() < 0.5 else x
            opt.zero_grad(set_to_none=True)
            micro = list(zip(x.chunk(args.accum), y.chunk(args.accum), strict=True))
            for i, (mx, my) in enumerate(micro):
                last = i == len(micro) - 1
                with contextlib.nullcontext() if last else model.no_sync():
                    (F.mse_loss(model(mx), my) / len(micro)).backward()
            opt.step()
            sched.step()
            _log(args.step_log, agent.rank, step.k, "end")


def _log(path: str | None, rank: int, step: int, event: str) -> None:
    if path:
        with open(path, "a") as log:
            log.write(f"{rank} {step} {os.getpid()} {time.time():.6f} {event}\n")


if __name__ == "__main__":
    main()
