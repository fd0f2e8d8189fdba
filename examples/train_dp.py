"""A data-parallel training script under the torchpass agent: the lines marked `torchpass` are all
it takes.

Run it with `torchpass run --nproc 4 --spares 1 examples/train_dp.py -- --steps 200`.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from job_agent import RankAgent  # torchpass


def build(width: int, depth: int) -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    layers.append(torch.nn.Linear(width, 1))
    return torch.nn.Sequential(*layers)


def main(agent_type: type[RankAgent] = RankAgent) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument(
        "--fail-at", type=int, default=-1, help="raise an error at this step (a bug in the script)"
    )
    p.add_argument(
        "--pace",
        type=float,
        default=0.0,
        help="seconds each step waits (to watch a run; the math is the same)",
    )
    p.add_argument("--save", help="rank 0 saves the final weights here, after the training loop")
    args = p.parse_args()

    agent = agent_type()  # torchpass
    torch.manual_seed(1234)  # the same initial weights on every rank
    model = build(args.width, args.depth).to(agent.device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    agent.track(model, opt)  # torchpass

    def train_step(step: int) -> None:
        # Per-rank data from (step, rank): the agent seeds torch's RNG for each step.
        time.sleep(args.pace)
        x = torch.randn(args.batch, args.width, device=agent.device)
        y = x.sum(dim=1, keepdim=True).sin()
        if step == args.fail_at:
            raise ValueError(f"bug in the training script at step {step}")
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        agent.all_reduce_gradients()  # torchpass
        opt.step()

    agent.run(train_step, steps=args.steps)  # torchpass
    if args.save and agent.rank == 0:  # code after the loop, as scripts end
        torch.save(model.state_dict(), args.save)


if __name__ == "__main__":
    main()
