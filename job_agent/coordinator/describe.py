"""What a running job says about itself for environment validation: its world, spares, torch and layout.

Read on the coordinator's event loop (the `describe_job` activity); it changes nothing.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

import torchpass
from torchpass.validation.checks import JobDescription

if TYPE_CHECKING:
    from job_agent.coordinator.coordinator import Coordinator


def describe(c: Coordinator) -> JobDescription:
    """The job as its coordinator sees it now.

    The backend is the one the ranks choose (`RankAgent` uses nccl when CUDA is present, else gloo); the
    local launcher runs the ranks on this host, so this host's torch answers for them. The replicas per
    shard are counted from the shard each rank reported holding; a rank that has not reported one is a
    shard of its own (never assumed to be a replica).
    """
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    available = dist.is_nccl_available() if cuda else dist.is_gloo_available()
    replicas = Counter(c.roster.shards.get(slot, f"unreported-rank-{slot}") for slot in range(c.world_size))
    return JobDescription(
        job_id=c.job_id,
        agent_version=torchpass.__version__,
        state=c.state.value,
        generation=c.generation,
        world_size=c.world_size,
        ranks_connected=len(c.roster.ranks()),
        live_migration=c.spec.agent,
        spares_ready=len(c.spares.ready()),
        spares_warming=c.spares.warming(),
        backend=backend,
        backend_available=available,
        torch_version=str(torch.__version__),
        cuda_available=cuda,
        nccl_version=_nccl_version() if cuda else None,
        shard_replicas=dict(replicas),
    )


def _nccl_version() -> str | None:
    try:
        v = torch.cuda.nccl.version()
    except (RuntimeError, AttributeError):  # a build without NCCL
        return None
    return ".".join(str(p) for p in v) if isinstance(v, tuple) else str(v)
