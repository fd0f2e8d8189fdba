"""A small character-level GPT trained the way nanoGPT trains (its structure: token and position
embeddings, pre-norm causal self-attention blocks, a tied head; random windows of the text per
batch; AdamW with weight decay on matrices only, a warm-up then cosine learning rate, gradient
clipping, autocast and a GradScaler), written for torchpass: the model in stock DDP, the loop in the
agent's form, the scheduler and the scaler tracked. bfloat16 autocast and a scaler on the CPU;
float16 on a GPU.

Run it with `torchpass run --nproc 4 --spares 1 examples/train_gpt.py -- --steps 300`.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from job_agent import RankAgent  # torchpass

TEXT = (
    "It is a truth universally acknowledged, that a training job in possession of many GPUs, must "
    "be in want of a spare. However little known the feelings or views of such a rank may be on "
    "its first entering a collective, this truth is so well fixed in the minds of the surrounding "
    "ranks, that it is considered the rightful property of some one or other of their peers. "
) * 8


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )
        self.heads, self.drop = heads, nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(
        self, vocab: int, block: int, width: int, layers: int, heads: int, dropout: float
    ) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(block, width)
        self.blocks = nn.Sequential(*(Block(width, heads, dropout) for _ in range(layers)))
        self.ln, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as in GPT-2

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        logits = self.head(self.ln(self.blocks(self.tok(idx) + self.pos(pos))))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=10)
    args = p.parse_args()

    agent = RankAgent()  # torchpass
    device = agent.device
    chars = sorted(set(TEXT))
    data = torch.tensor([chars.index(c) for c in TEXT], dtype=torch.long)
    torch.manual_seed(1337)
    model = GPT(len(chars), args.block, args.width, args.layers, args.heads, args.dropout).to(
        device
    )
    model = DDP(model)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )

    def lr_at(step: int) -> float:  # linear warm-up, then cosine down to a tenth
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    amp = torch.bfloat16 if device.type == "cpu" else torch.float16
    scaler = torch.amp.GradScaler(device.type)
    agent.track(model, opt, sched=sched, scaler=scaler)  # torchpass

    for step in agent.steps(args.steps):  # torchpass
        with step:  # torchpass
            # Random windows, as nanoGPT's get_batch: torch's RNG, seeded by the agent per (step,
            # rank).
            ix = torch.randint(len(data) - args.block - 1, (args.batch,))
            x = torch.stack([data[i : i + args.block] for i in ix]).to(device)
            y = torch.stack([data[i + 1 : i + 1 + args.block] for i in ix]).to(device)
            with torch.autocast(device.type, dtype=amp):
                loss = model(x, y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            if agent.rank == 0 and step.k % 50 == 0:
                print(f"step {step.k}: loss {loss.item():.3f}", flush=True)


if __name__ == "__main__":
    main()
