"""An MNIST-style convolutional classifier under torchpass, shaped like PyTorch's `examples/mnist`
trainer (two convolutions, max-pooling, two dropouts, log-softmax + NLL loss, Adadelta with a
`StepLR` decay per epoch) made data-parallel with stock DDP, its `DataLoader` reading with worker
processes that augment each image at random (a shift and pixel noise drawn in the worker). The code
is ours.

The images are synthetic (28 x 28, ten classes, each a fixed random pattern plus noise), so it runs
with no download; the structure, not the accuracy, is the point.

Run it with `torchpass run --nproc 4 --spares 1 examples/train_mnist.py -- --steps 100`.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from job_agent import RankAgent  # torchpass


class Digits(Dataset[tuple[torch.Tensor, int]]):
    """Ten fixed 28 x 28 patterns; item i is pattern i % 10, shifted and noised at random when
    read."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.patterns = torch.rand(10, 1, 28, 28, generator=torch.Generator().manual_seed(11))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        # torch's RNG here is the worker's, seeded by the DataLoader from the pass's own seed.
        dx, dy = (int(v) for v in torch.randint(-2, 3, (2,)))
        image = torch.roll(self.patterns[i % 10], shifts=(dx, dy), dims=(1, 2))
        return (image + 0.3 * torch.randn_like(image) - 0.5) / 0.3, i % 10


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 16, 3, 1)
        self.conv2 = torch.nn.Conv2d(16, 32, 3, 1)
        self.dropout1 = torch.nn.Dropout(0.25)
        self.dropout2 = torch.nn.Dropout(0.5)
        self.fc1 = torch.nn.Linear(32 * 12 * 12, 64)
        self.fc2 = torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = self.dropout1(torch.flatten(x, 1))
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--samples", type=int, default=1024)
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes per rank")
    p.add_argument("--lr", type=float, default=1.0)
    args = p.parse_args()

    agent = RankAgent()  # torchpass: in place of dist.init_process_group()
    torch.manual_seed(1)
    model = DDP(Net().to(agent.device))
    opt = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    data = Digits(args.samples)
    loader = DataLoader(
        data,
        batch_size=args.batch,
        sampler=DistributedSampler(data),
        num_workers=args.workers,
        drop_last=True,
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=len(loader), gamma=0.7)  # 0.7 each epoch
    agent.track(model, opt, sched=sched)  # torchpass

    for step in agent.steps(args.steps, data=loader):  # torchpass: `for x, y in loader:` before
        with step:  # torchpass
            x, y = (t.to(agent.device) for t in step.batch)
            opt.zero_grad(set_to_none=True)
            F.nll_loss(model(x), y).backward()
            opt.step()
            sched.step()


if __name__ == "__main__":
    main()
