"""The event-classification table: evidence of a failure -> a row of the product brief.

A pure function, no Temporal and no I/O, so that every example in the brief's qualifying and
disqualifying tables is one unit test. The rules, first match wins:

1. any shared-infrastructure evidence (fabric outage, filesystem, host memory) -> disqualifying;
2. some shard has lost every rank holding it (no healthy replica left to rebuild from), from the
   shards the ranks reported (or, without them, lost slots reaching the redundancy) -> unable to
   recover;
3. a failure (not a planned drain) of the Slurm batch host ("node 0": it runs the batch script and
   the coordinator, and Slurm ends the whole job with it) -> unable to recover;
4. no spare available -> unable to recover;
5. silent data corruption -> unable to recover;
6. otherwise the most specific qualifying row: host/GPU/fabric beats interruption beats planned,
   because a node power loss is also reported as dropped connections and exited processes.

The result never depends on the order in which evidence arrived.
"""

from __future__ import annotations

from collections.abc import Iterable

from torchpass.incident.steps import ConfirmResult
from torchpass.models import (
    QUALIFYING_CATEGORIES,
    Category,
    Classification,
    ClassifyInput,
    Evidence,
    FailureKind,
)

K = FailureKind

# Each category lists its kinds from the most to the least specific: the first one present names the
# incident (a power loss explains the connection losses and process exits that come with it).
KINDS_BY_CATEGORY: dict[Category, tuple[FailureKind, ...]] = {
    Category.SHARED_INFRASTRUCTURE: (
        K.FABRIC_OUTAGE,
        K.FILESYSTEM_UNMOUNTED,
        K.FILESYSTEM_FULL,
        K.HOST_MEMORY_EXHAUSTED,
    ),
    Category.UNABLE_TO_RECOVER: (K.SILENT_DATA_CORRUPTION,),
    Category.HOST_GPU_FABRIC: (
        K.GPU_FELL_OFF_BUS,
        K.GPU_ECC_UNCORRECTABLE,
        K.NVLINK_ERROR,
        K.NIC_ERROR,
        K.GPU_TEMPERATURE,
        K.GPU_LOST,
        K.NODE_POWER_LOSS,
        K.NODE_FAILURE,
        K.NODE_NOT_READY,
    ),
    Category.INTERRUPTION: (
        K.KERNEL_PANIC,
        K.OOM_KILL,
        K.CUDA_ERROR,
        K.NCCL_ERROR,
        K.COLLECTIVE_TIMEOUT,
        K.HANG,
        K.POD_DELETED,
        K.PROCESS_EXIT,
        K.HEARTBEAT_LOST,
        K.CONNECTION_LOST,
    ),
    Category.PLANNED: (K.NODE_DRAIN, K.NODE_CORDON),
}

CATEGORY_OF: dict[FailureKind, Category] = {
    kind: category for category, kinds in KINDS_BY_CATEGORY.items() for kind in kinds
}

# Which category names an incident when evidence is mixed; disqualifying evidence first.
_PRECEDENCE: tuple[Category, ...] = (
    Category.SHARED_INFRASTRUCTURE,
    Category.UNABLE_TO_RECOVER,
    Category.HOST_GPU_FABRIC,
    Category.INTERRUPTION,
    Category.PLANNED,
)

_RANK: dict[FailureKind, int] = {
    kind: i for i, kind in enumerate(k for c in _PRECEDENCE for k in KINDS_BY_CATEGORY[c])
}

# The brief's row titles, quoted so that a reason can be traced to the contract.
ROW_TITLE: dict[Category, str] = {
    Category.PLANNED: "Planned migration via Cordon (K8s) or DRAIN state (Slurm) or other "
    "supported signal",
    Category.INTERRUPTION: "Job, process or training execution interruption",
    Category.HOST_GPU_FABRIC: "Host, GPU, or local fabric failure",
    Category.SHARED_INFRASTRUCTURE: "Shared infrastructure failure",
    Category.UNABLE_TO_RECOVER: "Unable to recover",
}

# a reason names the kinds and domains it saw: a node with 256 reports stays readable
MAX_REASON = 4000
SDC_REASON = "silent data corruption"
NO_SPARE_REASON = "no spare available (failures due to spare resources not being available)"
NO_AGENT_REASON = (
    "not configured for live migration: the script runs without the torchpass agent (--no-agent), "
    "so only a whole-job restart from its own checkpoint is possible; with the agent "
    "(docs/adopting.md) this failure would have been a live migration"
)


def primary_kind(evidence: Iterable[Evidence]) -> FailureKind:
    """The kind that determined the category: the most specific kind of the winning category."""
    kinds = {e.kind for e in evidence}
    if not kinds:
        raise ValueError("no evidence")
    return min(kinds, key=_RANK.__getitem__)


def classify_input(
    evidence: tuple[Evidence, ...], confirm: ConfirmResult | None, spare_lost: bool = False
) -> ClassifyInput:
    """What the classifier sees of an incident: its evidence and what the job measured at confirm
    (the lost slots, the shards, whether spares were there; `spare_lost`: the reservation then found
    none)."""
    if confirm is None:
        return ClassifyInput(evidence=evidence, world_size=0, redundancy=0)
    ready = confirm.spares_ready
    enough = ready is None or ready + confirm.spares_warming >= len(confirm.lost_slots)
    return ClassifyInput(
        evidence=evidence,
        lost_slots=confirm.lost_slots,
        world_size=confirm.world_size,
        redundancy=confirm.redundancy,
        shard_of=confirm.shard_of,
        spare_available=enough and not spare_lost,
        agent=confirm.agent,
        leaving_slots=confirm.leaving_slots,
        batch_host=confirm.batch_host,
    )


def classify(inp: ClassifyInput) -> Classification:
    """Map the evidence of one incident to a row of the brief's tables, with a reason naming the
    row."""
    kind = primary_kind(inp.evidence)
    category = CATEGORY_OF[kind]
    if category is Category.SHARED_INFRASTRUCTURE:
        c = _disqualified(category, f"{_kinds(inp.evidence, category)} affects more than this job")
        return c.model_copy(update={"kind": kind})
    for reason in _unable_reasons(inp):
        return unable_to_recover(reason).model_copy(update={"kind": kind})
    return Classification(
        category=category,
        qualifying=True,
        reason=f"{ROW_TITLE[category]} (qualifying): {_kinds(inp.evidence, category)}"
        f" on {_domains(inp.evidence)}"[:MAX_REASON],
        kind=kind,
    )


def resyncs(c: Classification) -> bool:
    """Whether the only reason an incident is unable to recover is a replica that differs from its
    shard's majority (the other reasons come first): the majority's state rebuilds it, live."""
    return c.kind is K.SILENT_DATA_CORRUPTION and c.reason.startswith(
        unable_to_recover(SDC_REASON).reason
    )


def unable_to_recover(reason: str) -> Classification:
    """The disqualifying 'Unable to recover' row with its specific reason."""
    return _disqualified(Category.UNABLE_TO_RECOVER, reason)


def unclassified(error: str) -> Classification:
    """The classification step failed: qualifying, with why. Reads no table, so a workflow may call
    it."""
    return Classification(
        category=Category.UNCLASSIFIED,
        qualifying=True,
        reason=f"not classified ({error[:1000]}); counted as qualifying: torchpass's own failure "
        "never disqualifies a customer's failure",
    )


def _unable_reasons(inp: ClassifyInput) -> Iterable[str]:
    if not inp.agent:
        yield NO_AGENT_REASON
    # A rank a planned move takes out while healthy gives its own state: only a failed slot needs a
    # replica.
    lost = set(inp.lost_slots) - set(inp.leaving_slots)
    if lost and inp.shard_of:
        orphaned = sorted({s for s in inp.shard_of.values() if _holders(inp, s) <= lost})
        if orphaned:
            yield (
                f"failures exceeding parallelism redundancy: slot(s) {sorted(lost)} held every "
                f"replica of shard(s) {', '.join(orphaned)}, no healthy replica left"
            )
    elif lost and len(lost) >= inp.redundancy:
        yield (
            f"failures exceeding parallelism redundancy: {len(lost)} slot(s) lost"
            f" {sorted(lost)} with redundancy {inp.redundancy}, no healthy replica left"
        )
    if _slurm_node0(inp):
        yield (
            f"node 0 failures with Slurm: {inp.batch_host} is the allocation's batch host (it runs "
            "the batch script and the coordinator; Slurm ends the whole job with it)"
        )
    if not inp.spare_available:
        yield NO_SPARE_REASON
    if corrupt := [e for e in inp.evidence if e.kind is K.SILENT_DATA_CORRUPTION]:
        yield f"{SDC_REASON}: {corrupt[0].detail}"


def _holders(inp: ClassifyInput, shard: str) -> set[int]:
    return {slot for slot, s in inp.shard_of.items() if s == shard}


def _slurm_node0(inp: ClassifyInput) -> bool:
    """A failure of the Slurm batch host. A drain of it is planned, not a failure: it keeps running
    while its ranks move. Whichever node ran rank 0 is not special: its ranks move like any
    other's."""
    return inp.batch_host is not None and any(
        e.failure_domain == inp.batch_host for e in inp.evidence if not planned(e)
    )


def planned(ev: Evidence) -> bool:
    """A planned move's signal (cordon, drain, a GPU warming up): its ranks are still healthy."""
    return CATEGORY_OF[ev.kind] is Category.PLANNED


def leaving_slots(evidence: Iterable[Evidence]) -> set[int]:
    """Slots whose every report is a planned signal: ranks a planned move takes out while healthy,
    each the donor of its own state."""
    evidence = list(evidence)
    failed = {s for ev in evidence if not planned(ev) for s in ev.slots}
    return {s for ev in evidence if planned(ev) for s in ev.slots} - failed


def _disqualified(category: Category, reason: str) -> Classification:
    assert category not in QUALIFYING_CATEGORIES
    return Classification(
        category=category,
        qualifying=False,
        reason=f"{ROW_TITLE[category]} (disqualifying): {reason}"[:MAX_REASON],
    )


def _kinds(evidence: Iterable[Evidence], category: Category) -> str:
    kinds = sorted(
        {e.kind for e in evidence if CATEGORY_OF[e.kind] is category}, key=_RANK.__getitem__
    )
    return ", ".join(kinds)


def _domains(evidence: Iterable[Evidence]) -> str:
    return ", ".join(sorted({e.failure_domain for e in evidence}))
