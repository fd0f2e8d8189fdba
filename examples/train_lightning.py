"""A Lightning `Trainer` script, migrated live: a LightningModule (an MLP with dropout, AdamW and a
cosine schedule stepped per step), a shuffled DataLoader (Lightning gives it a DistributedSampler),
checkpoints every few steps. The lines marked `torchpass` are all it takes.

Run it with `torchpass run --nproc 2 --spares 1 examples/train_lightning.py -- --out /tmp/pl`.
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from job_agent import RankAgent  # torchpass
from job_agent.frameworks.lightning_trainer import LiveDDPStrategy  # torchpass


class Classifier(pl.LightningModule):
    def __init__(self, width: int, steps: int) -> None:
        super().__init__()
        self.steps = steps
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, width),
            torch.nn.ReLU(),
            torch.nn.Dropout(0.1),
            torch.nn.Linear(width, 10),
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--out", required=True, help="where checkpoints go")
    p.add_argument("--save-steps", type=int, default=10)
    p.add_argument("--final", default=None, help="save the model's weights here after training")
    args = p.parse_args()

    agent = RankAgent()  # torchpass: first, before the Trainer
    torch.manual_seed(1234)  # the same initial weights on every rank
    model = Classifier(args.width, args.steps)
    g = torch.Generator().manual_seed(7)
    data = TensorDataset(
        torch.randn(640, 32, generator=g), torch.randint(0, 10, (640,), generator=g)
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=agent.world_size,
        strategy=LiveDDPStrategy(agent),  # torchpass: the agent's step boundary in the loop
        max_steps=args.steps,
        callbacks=[
            ModelCheckpoint(dirpath=args.out, every_n_train_steps=args.save_steps, save_top_k=-1)
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=16, shuffle=True))
    if args.final and trainer.is_global_zero:
        torch.save(model.state_dict(), args.final)


if __name__ == "__main__":
    main()
