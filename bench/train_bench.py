"""The benchmark's training loop, runnable under the agent or as plain torch.distributed (for
overhead).

Plain mode reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT and does the same fixed-order
bucketed all-reduce as the agent, so the only difference measured is the agent itself.
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F


def build(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(1234)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--plain", action="store_true")
    p.add_argument(
        "--times", type=Path, required=True, help="rank 0 appends its step durations here"
    )
    args = p.parse_args()
    model = build(args.width, args.depth)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    # per-step cost = time between step starts: the agent's own work included
    starts: list[float] = []

    def compute(step: int) -> None:
        x = torch.randn(args.batch, args.width)
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x), x.sum(1, keepdim=True).sin()).backward()

    if args.plain:
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        from job_agent.rank.tensors import (  # the agent's own: the same all-reduce
            GRAD_BUCKET_BYTES,
            bucketize,
        )

        buckets = bucketize(list(model.parameters()), GRAD_BUCKET_BYTES)
        for step in range(args.steps):
            starts.append(time.perf_counter())
            torch.manual_seed(step * 1000 + rank)
            compute(step)
            for bucket in buckets:
                grads = [p.grad for p in bucket]
                flat = torch._utils._flatten_dense_tensors(grads)
                dist.all_reduce(flat)
                flat.div_(world)
                for g, r in zip(
                    grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True
                ):
                    g.copy_(r)  # type: ignore[union-attr]
            opt.step()
        starts.append(time.perf_counter())
        dist.destroy_process_group()
        is_zero = rank == 0
    else:
        from job_agent import RankAgent

        agent = RankAgent()
        agent.track(model, opt)

        def train_step(step: int) -> None:
            starts.append(time.perf_counter())
            compute(step)
            agent.all_reduce_gradients()
            opt.step()

        agent.run(train_step, steps=args.steps)
        starts.append(time.perf_counter())
        is_zero = agent.rank == 0
    if is_zero:
        with args.times.open("a") as f:
            f.write(" ".join(f"{b - a:.6f}" for a, b in itertools.pairwise(starts)) + "\n")


if __name__ == "__main__":
    main()
