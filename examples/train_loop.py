"""A data-parallel training script in the loop form: a `DataLoader` with a `DistributedSampler`, an
LR scheduler, and the step loop written as a `for`. The lines marked `torchpass` are all it takes.

Run it with `torchpass run --nproc 4 --spares 1 examples/train_loop.py -- --steps 200`.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
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
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--samples", type=int, default=1024)
    p.add_argument("--stop-at", type=int, default=-1, help="stop early after this step (a `break`)")
    args = p.parse_args()

    agent = RankAgent()  # torchpass
    torch.manual_seed(1234)  # the same initial weights on every rank
    layers: list[torch.nn.Module] = []
    for _ in range(args.depth):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(args.width, 1)).to(agent.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=25, gamma=0.5)
    # A spare has no rank until it is given one (agent.rank is -1): the agent sets the sampler's
    # rank and epoch before each pass over the data.
    sampler = DistributedSampler(
        dataset(args.samples, args.width),
        num_replicas=agent.world_size,
        rank=max(agent.rank, 0),
        seed=3,
    )
    loader = DataLoader(sampler.dataset, batch_size=args.batch, sampler=sampler, drop_last=True)
    agent.track(model, opt, sched=sched)  # torchpass

    for step in agent.steps(args.steps, data=loader):  # torchpass
        with step:  # torchpass: a peer lost in here -> this step is done again, same batch
            x, y = (t.to(agent.device) for t in step.batch)
            opt.zero_grad(set_to_none=True)
            F.mse_loss(model(x), y).backward()
            agent.all_reduce_gradients()  # torchpass
            opt.step()
            sched.step()
        if step.k == args.stop_at:  # early stopping: every rank breaks at the same step
            break


if __name__ == "__main__":
    main()
