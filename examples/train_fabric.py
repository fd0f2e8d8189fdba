"""A Lightning Fabric script, migrated live: Fabric sets up DDP, the optimizer and the distributed
data loader; the agent's loop form runs the steps. The lines marked `torchpass` are all it takes.

Run it with `torchpass run --nproc 2 --spares 1 examples/train_fabric.py -- --steps 60`.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, TensorDataset

from job_agent import RankAgent  # torchpass
from job_agent.frameworks.lightning import LiveFabricStrategy  # torchpass


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--width", type=int, default=64)
    args = p.parse_args()

    agent = RankAgent()  # torchpass: before Fabric, which finds the job's group
    fabric = Fabric(
        accelerator="cpu",
        devices=agent.world_size,
        strategy=LiveFabricStrategy(agent),  # torchpass: the agent's processes, ranks and devices
    )
    fabric.launch()
    torch.manual_seed(1234)  # the same initial weights on every rank
    model = torch.nn.Sequential(
        torch.nn.Linear(32, args.width),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.1),
        torch.nn.Linear(args.width, 10),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    model, opt = fabric.setup(model, opt)
    g = torch.Generator().manual_seed(7)
    data = TensorDataset(
        torch.randn(1024, 32, generator=g), torch.randint(0, 10, (1024,), generator=g)
    )
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=16, shuffle=True))
    agent.track(model, opt.optimizer, sched=sched)  # torchpass
    for step in agent.steps(args.steps, data=loader):  # torchpass: the agent's loop form
        with step:
            x, y = step.batch
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            fabric.backward(loss)
            opt.step()
            sched.step()


if __name__ == "__main__":
    main()
