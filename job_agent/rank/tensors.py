"""Where a rank's tensors live and what its host offers them, how its gradients are grouped for the
all-reduce, and its per-step seed."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from job_agent import wire

GRAD_BUCKET_BYTES = 25 * 2**20  # gradients all-reduced together, at most this many bytes a bucket


def bucketize(params: Sequence[torch.Tensor], cap_bytes: int) -> list[list[torch.Tensor]]:
    buckets: list[list[torch.Tensor]] = [[]]
    size = 0
    for p in params:
        n = p.numel() * p.element_size()
        if buckets[-1] and size + n > cap_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += n
    return buckets


def pick_device(name: str, local_rank: int) -> torch.device:
    if name != "auto":
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def environment(device: torch.device) -> wire.Environment:
    """What this rank's torch says of its host (the job's environment validation reads it)."""
    cuda = device.type == "cuda"
    return wire.Environment(
        torch_version=str(torch.__version__)[:64],
        backend="nccl" if cuda else "gloo",
        backend_available=dist.is_nccl_available() if cuda else dist.is_gloo_available(),
        cuda_available=torch.cuda.is_available(),
        nccl_version=_nccl_version() if cuda else None,
        cuda_version=torch.version.cuda,
        driver_version=_driver_version() if torch.cuda.is_available() else None,
    )


def _driver_version() -> str | None:
    """The GPU driver's version, as NVML says it; None where NVML cannot be read."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            v = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML library, no driver: the check says unknown
        return None
    return (v.decode() if isinstance(v, bytes) else str(v))[:64]


def _nccl_version() -> str | None:
    try:
        v = torch.cuda.nccl.version()
    except (RuntimeError, AttributeError):  # a build without NCCL
        return None
    return ".".join(str(p) for p in v) if isinstance(v, tuple) else str(v)


def step_seed(seed: int, step: int, slot: int) -> int:
    """splitmix64 of (seed, step, slot): per-rank, per-step randomness that never has to be
    moved."""
    x = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + slot * 0x94D049BB133111EB) % 2**64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % 2**64
    return (x ^ (x >> 31)) % 2**63
