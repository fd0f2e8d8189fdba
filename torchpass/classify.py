"""Classification of a failure against the brief's tables of qualifying and disqualifying events. Pure."""

from __future__ import annotations

from collections.abc import Sequence

from torchpass.models import (
    QUALIFYING_CATEGORIES,
    Category,
    Classification,
    ClassifyInput,
    Evidence,
    FailureKind,
)

K = FailureKind
CATEGORY: dict[FailureKind, Category] = {
    K.NODE_CORDON: Category.PLANNED,
    K.NODE_DRAIN: Category.PLANNED,
    K.PROCESS_EXIT: Category.INTERRUPTION,
    K.CONNECTION_LOST: Category.INTERRUPTION,
    K.HEARTBEAT_LOST: Category.INTERRUPTION,
    K.HANG: Category.INTERRUPTION,
    K.POD_DELETED: Category.INTERRUPTION,
    K.KERNEL_PANIC: Category.INTERRUPTION,
    K.OOM_KILL: Category.INTERRUPTION,
    K.CUDA_ERROR: Category.INTERRUPTION,
    K.NCCL_ERROR: Category.INTERRUPTION,
    K.GPU_FELL_OFF_BUS: Category.HOST_GPU_FABRIC,
    K.GPU_ECC_UNCORRECTABLE: Category.HOST_GPU_FABRIC,
    K.GPU_LOST: Category.HOST_GPU_FABRIC,
    K.GPU_TEMPERATURE: Category.HOST_GPU_FABRIC,
    K.NVLINK_ERROR: Category.HOST_GPU_FABRIC,
    K.NIC_ERROR: Category.HOST_GPU_FABRIC,
    K.NODE_POWER_LOSS: Category.HOST_GPU_FABRIC,
    K.NODE_NOT_READY: Category.HOST_GPU_FABRIC,
    K.NODE_FAILURE: Category.HOST_GPU_FABRIC,
    K.FABRIC_OUTAGE: Category.SHARED_INFRASTRUCTURE,
    K.FILESYSTEM_UNMOUNTED: Category.SHARED_INFRASTRUCTURE,
    K.FILESYSTEM_FULL: Category.SHARED_INFRASTRUCTURE,
    K.HOST_MEMORY_EXHAUSTED: Category.SHARED_INFRASTRUCTURE,
    K.SILENT_DATA_CORRUPTION: Category.UNABLE_TO_RECOVER,
}
# When one failure is seen several ways (a power loss also drops connections and ends processes), the
# most specific observation names it.
_PRECEDENCE = (
    Category.SHARED_INFRASTRUCTURE,
    Category.UNABLE_TO_RECOVER,
    Category.HOST_GPU_FABRIC,
    Category.INTERRUPTION,
    Category.PLANNED,
)
_ROW = {
    Category.PLANNED: "Planned migration via cordon, drain or another supported signal",
    Category.INTERRUPTION: "Job, process or training execution interruption",
    Category.HOST_GPU_FABRIC: "Host, GPU or local fabric failure",
    Category.SHARED_INFRASTRUCTURE: "Shared infrastructure failure",
    Category.UNABLE_TO_RECOVER: "Unable to recover",
}


def primary_kind(evidence: Sequence[Evidence]) -> FailureKind:
    """The observation that determines the category: the first of the highest-precedence category."""
    if not evidence:
        raise ValueError("no evidence")
    return min(evidence, key=lambda e: (_PRECEDENCE.index(CATEGORY[e.kind]), e.observed_at)).kind


def classify(inp: ClassifyInput) -> Classification:
    kind = primary_kind(inp.evidence)
    category = CATEGORY[kind]

    def result(cat: Category, why: str) -> Classification:
        qualifying = cat in QUALIFYING_CATEGORIES
        label = "qualifying" if qualifying else "disqualifying"
        return Classification(category=cat, qualifying=qualifying, reason=f"{_ROW[cat]} ({label}): {why}.")

    if category == Category.SHARED_INFRASTRUCTURE:
        return result(category, f"{kind.value} affects shared infrastructure, not one node")
    if category == Category.UNABLE_TO_RECOVER:
        return result(category, f"{kind.value}")
    if inp.redundancy and len(inp.lost_slots) >= inp.redundancy:
        return result(
            Category.UNABLE_TO_RECOVER,
            f"{len(inp.lost_slots)} ranks lost, parallelism redundancy {inp.redundancy}: no healthy replica",
        )
    if 0 in inp.lost_slots and any(e.scheduler == "slurm" for e in inp.evidence):
        return result(Category.UNABLE_TO_RECOVER, "node 0 failed under Slurm")
    if not inp.spare_available:
        return result(Category.UNABLE_TO_RECOVER, "no spare resources were available")
    return result(category, f"{kind.value} observed on {inp.evidence[0].failure_domain}")
