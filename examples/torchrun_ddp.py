"""An unmodified torchrun script: it never imports torchpass. It forms its group from torchrun's
environment, wraps its model in DDP, saves a checkpoint every few steps (rank 0's `torch.save`, or every
rank's part with `torch.distributed.checkpoint`: `--save dcp`) and, when started again, resumes from it,
mid-epoch included (the pattern of the PyTorch DDP and elastic tutorials).

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
        choices=["path", "file", "dcp"],
        default="path",
        help="torch.save to the path, torch.save to a file opened on it, or torch.distributed.checkpoint",
    )
    p.add_argument("--step-log", help="append 'rank step pid unix-time begin|end' for each step (benchmarks)")
    args = p.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank()
    device = torch.device(f"cuda:{os.environ['LOCAL_RANK']}" if torch.cuda.is_available() else "cpu")
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
                save(args.save, args.ckpt, model, opt, step)
            _log(args.step_log, rank, step, "end")
            step += 1
            if step >= args.steps:
                break
    dist.destroy_process_group()


def save(how: str, path: str, model: DDP, opt: torch.optim.Optimizer, step: int) -> None:
    """The checkpoint: rank 0's `torch.save` (to the path or a file), or every rank's part (DCP)."""
    if how == "dcp":
        model_state, opt_state = get_state_dict(model, opt)
        dcp.save({"model": model_state, "opt": opt_state, "step": torch.tensor(step)}, checkpoint_id=path)
    elif dist.get_rank() == 0:
        state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step}
        if how == "file":
            with open(path, "wb") as f:
                torch.save(state, f)
        else:
            torch.save(state, path)


def load(how: str, path: str, model: DDP, opt: torch.optim.Optimizer, device: torch.device) -> int:
    """Load the checkpoint into the model and optimizer; its step."""
    if how == "dcp":
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
