"""A DDP script whose replicas drift apart: a `BatchNorm1d` wrapped with `broadcast_buffers=False`,
so each rank's running statistics follow its own batches (pass `--broadcast-buffers` for DDP's
default, `--no-ddp` for the same model reduced by the agent, with nothing to make the statistics
agree). `--die-after-step K`: rank 0 (as first started, not a spare that took its slot) SIGKILLs
itself right after its optimizer's step of step K, before the step ends. `--log-loss`: the loss is
all-reduced for logging after the optimizer's step (a collective a step must not have there).
`--zero-grad-last`: the gradients are cleared as the step ends (as nanoGPT does), not before the
backward."""

from __future__ import annotations

import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from job_agent import RankAgent


def main() -> None:
    agent = RankAgent()
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 1)
    )
    no_ddp = "--no-ddp" in sys.argv
    model = net if no_ddp else DDP(net, broadcast_buffers="--broadcast-buffers" in sys.argv)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    agent.track(model, opt)
    die = (
        int(sys.argv[sys.argv.index("--die-after-step") + 1])
        if "--die-after-step" in sys.argv
        else -1
    )
    for step in agent.steps(30):
        with step:
            # seeded by the agent from (seed, step, rank): other data on each rank
            x = torch.randn(8, 16)
            if "--zero-grad-last" not in sys.argv:
                opt.zero_grad()
            loss = F.mse_loss(model(x), x.sum(1, keepdim=True))
            loss.backward()
            if no_ddp:
                agent.all_reduce_gradients()
            opt.step()
            if step.k == die and agent.rank == 0 and agent.settings.role == "rank":
                os.kill(os.getpid(), signal.SIGKILL)
            if "--log-loss" in sys.argv:
                dist.all_reduce(loss.detach())
            if "--zero-grad-last" in sys.argv:
                opt.zero_grad()


if __name__ == "__main__":
    main()
