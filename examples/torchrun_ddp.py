"""An unmodified torchrun script: it never imports torchpass. It forms its group from torchrun's
environment, wraps its model in DDP, saves a checkpoint every few steps (rank 0's `torch.save`, or
every rank's part with `torch.distributed.checkpoint`: `--save dcp`, or `dcp.async_save` on a group
of its own: `--save dcp-async`) and, when started again, resumes from it, mid-epoch included (the
pattern of the PyTorch DDP and elastic tutorials).

The same file runs under torchrun and under torchpass without the agent:

    torchrun --nproc-per-node 4 examples/torchrun_ddp.py --ckpt /tmp/ckpt.pt
    torchpass run --no-agent --nproc 4 examples/torchrun_ddp.py -- --ckpt /tmp/ckpt.pt

Under torchpass a failure is an incident with its workflow, recorded as "not configured for live
migration", and the whole job restarts from the script's checkpoint (torchrun's --max-restarts).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--depth", type=int, default=1, help="hidden Linear(width, width) layers")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--samples", type=int, default=2048)
    p.add_argument("--ckpt", required=True, help="checkpoint path (resumed from when it exists)")
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument(
        "--save",
        choices=["path", "file", "dcp", "dcp-async"],
        default="path",
        help="torch.save to the path, torch.save to a file opened on it, or "
        "torch.distributed.checkpoint (dcp-async: its async_save, the next save waiting for the "
        "last)",
    )
    p.add_argument(
        "--step-log", help="append 'rank step pid unix-time begin|end' for each step (benchmarks)"
    )
    args = p.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank()
    device = torch.device(
        f"cuda:{os.environ['LOCAL_RANK']}" if torch.cuda.is_available() else "cpu"
    )
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(args.depth):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.GELU()]
    net = torch.nn.Sequential(*layers, torch.nn.Linear(args.width, 1)).to(device)
    model = DDP(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    start = 0
    if os.path.exists(args.ckpt):
        start = load(args.save, args.ckpt, model, opt, device) + 1
        if rank == 0:
            print(f"resumed from {args.ckpt} at step {start}", flush=True)

    g = torch.Generator().manual_seed(7)
    x = torch.randn(args.samples, args.width, generator=g)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True).sin())
    sampler = DistributedSampler(data, seed=3, drop_last=True)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler, drop_last=True)

    saver = Saver(args.save, args.ckpt)
    step = start
    while step < args.steps:
        epoch, skip = divmod(step, len(loader))
        sampler.set_epoch(epoch)
        for i, (xb, yb) in enumerate(loader):
            if i < skip:  # resuming mid-epoch: the batches before the checkpoint's step were done
                continue
            _log(args.step_log, rank, step, "begin")
            opt.zero_grad(set_to_none=True)
            F.mse_loss(model(xb.to(device)), yb.to(device)).backward()
            opt.step()
            if (step + 1) % args.ckpt_every == 0:
                saver.save(model, opt, step)
            _log(args.step_log, rank, step, "end")
            step += 1
            if step >= args.steps:
                break
    saver.wait()
    dist.destroy_process_group()


class Saver:
    """The checkpoint: rank 0's `torch.save` (to the path or a file), or every rank's part (DCP),
    saved in the background with `dcp-async` (on a gloo group of its own, as torch's docs advise, so
    that it never interleaves with the training's collectives; a save waits for the one before)."""

    def __init__(self, how: str, path: str) -> None:
        self.how, self.path = how, path
        self.group = dist.new_group(backend="gloo") if how == "dcp-async" else None
        self.pending: Any = None

    def save(self, model: DDP, opt: torch.optim.Optimizer, step: int) -> None:
        if self.how.startswith("dcp"):
            model_state, opt_state = get_state_dict(model, opt)
            state = {"model": model_state, "opt": opt_state, "step": torch.tensor(step)}
            if self.how == "dcp":
                dcp.save(state, checkpoint_id=self.path)
                return
            self.wait()
            self.pending = dcp.async_save(state, checkpoint_id=self.path, process_group=self.group)
        elif dist.get_rank() == 0:
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step}
            if self.how == "file":
                with open(self.path, "wb") as f:
                    torch.save(state, f)
            else:
                torch.save(state, self.path)

    def wait(self) -> None:
        if self.pending is not None:
            self.pending.result()
            self.pending = None


def load(how: str, path: str, model: DDP, opt: torch.optim.Optimizer, device: torch.device) -> int:
    """Load the checkpoint into the model and optimizer; its step."""
    if how.startswith("dcp"):
        model_state, opt_state = get_state_dict(model, opt)
        state = {"model": model_state, "opt": opt_state, "step": torch.tensor(0)}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["opt"])
        return int(state["step"])
    ckpt = torch.load(path, map_location=device, weights_only=True)
    model.module.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    return int(ckpt["step"])


def _log(path: str | None, rank: int, step: int, event: str) -> None:
    if path:
        with open(path, "a") as log:
            log.write(f"{rank} {step} {os.getpid()} {time.time():.6f} {event}\n")


if __name__ == "__main__":
    main()
