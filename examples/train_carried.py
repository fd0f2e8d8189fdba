"""A script that carries state from one step to the next on each rank: a recurrent model trained by
truncated back-propagation (its hidden state goes on from batch to batch, detached, as in PyTorch's
word_language_model example), or a loop that draws the next batch ahead of the step that uses it
(`--prefetch`). Each rank's carried state is its own: no replica holds it, so a rank that replaces
a lost one cannot be given it, and the run then differs from one that never failed.

Declared with `agent.carry` (the lines marked `torchpass`), a step done again starts from the
carried value as the step began, and a migration that replaces a rank's process is recorded as not
live, with why. `--undeclared` leaves it undeclared, as a script written without torchpass in mind:
the agent then sees the hidden state fed back to the model (and a batch drawn ahead, where a step is
done again) and records the migration as not live all the same, naming the fix.

Run it with `torchpass run --nproc 4 --spares 1 examples/train_carried.py -- --steps 200`.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F

from job_agent import RankAgent  # torchpass


class Model(torch.nn.Module):
    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.rnn = torch.nn.GRU(width, width, batch_first=True)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, hidden = self.rnn(self.embed(x), hidden)
        return self.head(out), hidden


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--vocab", type=int, default=50)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--bptt", type=int, default=8, help="tokens per truncated back-propagation")
    p.add_argument(
        "--prefetch", action="store_true", help="carry the next batch, not a hidden state"
    )
    p.add_argument("--undeclared", action="store_true", help="do not declare the carried state")
    args = p.parse_args()

    agent = RankAgent()  # torchpass
    torch.manual_seed(1234)  # the same initial weights on every rank
    model = Model(args.vocab, args.width).to(agent.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    agent.track(model, opt)  # torchpass

    def batch() -> torch.Tensor:  # per rank, per step: the agent seeds torch's RNG each step
        return torch.randint(0, args.vocab, (args.batch, args.bptt + 1), device=agent.device)

    first: Any = torch.zeros(1, args.batch, args.width, device=agent.device)
    if args.prefetch:
        first = torch.zeros(args.batch, args.bptt + 1, dtype=torch.long, device=agent.device)
    if args.undeclared:

        class Plain:
            value: Any = first

        carried: Any = Plain()
    else:
        carried = agent.carry("batch" if args.prefetch else "hidden", first)  # torchpass

    def train_step(step: int) -> None:
        if args.prefetch:  # the batch drawn last step; the next one drawn now
            data, carried.value = carried.value, batch()
            hidden = torch.zeros(1, args.batch, args.width, device=agent.device)
        else:  # a fresh batch; the hidden state goes on from the last one, detached
            data, hidden = batch(), carried.value.detach()
        opt.zero_grad(set_to_none=True)
        logits, hidden = model(data[:, :-1], hidden)
        F.cross_entropy(logits.reshape(-1, args.vocab), data[:, 1:].reshape(-1)).backward()
        agent.all_reduce_gradients()  # torchpass
        opt.step()
        if not args.prefetch:
            carried.value = hidden

    agent.run(train_step, steps=args.steps)  # torchpass


if __name__ == "__main__":
    main()
