"""FSDP2 (`fully_shard`) or HSDP (a replicate x shard device mesh) under torchpass: each block
sharded over the mesh, the whole model sharded last, AdamW, a warm-up + linear decay schedule, a
`DataLoader` over a default `DistributedSampler`. The structure is the one of PyTorch's FSDP2
tutorial and TorchTitan's `fully_shard` calls; the code is ours.

With `--replicas 1` (plain FSDP2) every rank holds a shard no other rank has: a lost rank cannot be
rebuilt from a peer, and torchpass falls back to the last checkpoint (the brief's "failures
exceeding parallelism redundancy"). With `--replicas 2` on 4 ranks (HSDP 2 x 2) each shard has a
replica in the other replica group, and a lost rank is migrated live from it.

Run it with `torchpass run --nproc 4 --spares 1 examples/train_fsdp.py -- --replicas 2`.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from job_agent import RankAgent  # torchpass


def dataset(n: int, width: int) -> TensorDataset:
    g = torch.Generator().manual_seed(7)  # the same data on every rank
    x = torch.randn(n, width, generator=g)
    return TensorDataset(x, x.sum(dim=1, keepdim=True).sin())


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--width", type=int, default=64, help="a multiple of the shard degree")
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--samples", type=int, default=1024)
    p.add_argument(
        "--replicas", type=int, default=2, help="1: FSDP2; more: HSDP, replicas x shards"
    )
    p.add_argument("--lr", type=float, default=2e-3)
    args = p.parse_args()

    agent = RankAgent()  # torchpass: in place of dist.init_process_group()
    world = agent.world_size
    if args.replicas > 1:
        shape, names = (args.replicas, world // args.replicas), ("replicate", "shard")
    else:
        shape, names = (world,), ("shard",)
    mesh = init_device_mesh(agent.device.type, shape, mesh_dim_names=names)

    torch.manual_seed(0)  # FSDP shards what each rank built: every rank builds the same model
    blocks = [Block(args.width) for _ in range(args.depth)]
    model = torch.nn.Sequential(*blocks, torch.nn.Linear(args.width, args.width)).to(agent.device)
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    warmup = max(1, args.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * max(0.0, 1 - s / args.steps)
    )
    data = dataset(args.samples, args.width)
    loader = DataLoader(
        data, batch_size=args.batch, sampler=DistributedSampler(data), drop_last=True
    )
    agent.track(model, opt, sched=sched)  # torchpass

    for step in agent.steps(args.steps, data=loader):  # torchpass: `for x, y in loader:` before
        with step:  # torchpass: a peer lost in here -> this step is done again, same batch
            x, y = (t.to(agent.device) for t in step.batch)
            opt.zero_grad(set_to_none=True)
            F.mse_loss(model(x).sum(dim=1, keepdim=True), y).backward()
            opt.step()
            sched.step()


if __name__ == "__main__":
    main()
