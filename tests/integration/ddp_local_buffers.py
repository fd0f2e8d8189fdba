"""A DDP script whose replicas drift apart: a `BatchNorm1d` wrapped with `broadcast_buffers=False`, so
each rank's running statistics follow its own batches (pass `--broadcast-buffers` for DDP's default,
`--no-ddp` for the same model reduced by the agent, with nothing to make the statistics agree)."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from job_agent import RankAgent


def main() -> None:
    agent = RankAgent()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 1))
    no_ddp = "--no-ddp" in sys.argv
    model = net if no_ddp else DDP(net, broadcast_buffers="--broadcast-buffers" in sys.argv)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    agent.track(model, opt)
    for step in agent.steps(30):
        with step:
            x = torch.randn(8, 16)  # seeded by the agent from (seed, step, rank): other data on each rank
            opt.zero_grad()
            F.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
            if no_ddp:
                agent.all_reduce_gradients()
            opt.step()


if __name__ == "__main__":
    main()
