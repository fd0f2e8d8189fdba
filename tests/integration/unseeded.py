"""A data-parallel script that builds its model before seeding it the same on every rank (pass
`--seeded` for the fix): each rank starts from its own weights. With `--stream-per-rank` (and
`--seeded`) the model is one, but a random stream it tracks is seeded per rank. With `--prefetch`
(and `--seeded`) it fetches its batches ahead, as nanoGPT does: the first before the loop, each next
one in the step before."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from job_agent import RankAgent


def main() -> None:
    agent = RankAgent()
    torch.manual_seed(0 if "--seeded" in sys.argv else 1000 + agent.rank)
    model = torch.nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    noise = torch.Generator().manual_seed(agent.rank if "--stream-per-rank" in sys.argv else 5)
    agent.track(model, opt, noise=noise)
    prefetch = "--prefetch" in sys.argv
    ahead = torch.randn(8, 16) if prefetch else None
    for step in agent.steps(5):
        with step:
            x = torch.randn(8, 16) if ahead is None else ahead
            x = x + 0.01 * torch.randn(8, 16, generator=noise)
            ahead = torch.randn(8, 16) if prefetch else None
            opt.zero_grad()
            F.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
            agent.all_reduce_gradients()
            opt.step()


if __name__ == "__main__":
    main()
