"""The classification table against every example in the product brief's two tables, plus its
properties."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from torchpass.incident.classify import (
    CATEGORY_OF,
    NO_AGENT_REASON,
    NO_SPARE_REASON,
    ROW_TITLE,
    classify,
    primary_kind,
    unclassified,
)
from torchpass.models import (
    QUALIFYING_CATEGORIES,
    Category,
    Classification,
    ClassifyInput,
    EventSource,
    Evidence,
    FailureKind,
)

K = FailureKind
T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
SHARED = [k for k, c in CATEGORY_OF.items() if c is Category.SHARED_INFRASTRUCTURE]


def ev(
    kind: FailureKind,
    source: EventSource = EventSource.COORDINATOR,
    slots: tuple[int, ...] = (2,),
    scheduler: str | None = None,
    domain: str = "node-2",
    xid: int | None = None,
    detail: str = "",
    at: int = 0,
) -> Evidence:
    return Evidence(
        kind=kind,
        source=source,
        job_id="job-1",
        failure_domain=domain,
        slots=slots,
        scheduler=scheduler,
        xid=xid,
        detail=detail,
        observed_at=T0 + timedelta(seconds=at),
    )


def run(
    *evidence: Evidence,
    lost: tuple[int, ...] | None = None,
    world: int = 4,
    redundancy: int = 4,
    spare: bool = True,
    batch_host: str | None = None,
) -> Classification:
    if lost is None:
        lost = tuple(sorted({s for e in evidence for s in e.slots}))
    return classify(
        ClassifyInput(
            evidence=evidence,
            lost_slots=lost,
            world_size=world,
            redundancy=redundancy,
            spare_available=spare,
            batch_host=batch_host,
        )
    )


def test_every_failure_kind_has_a_row() -> None:
    assert set(CATEGORY_OF) == set(FailureKind)


# --- Qualifying: planned migration via cordon (K8s), DRAIN (Slurm) or another supported signal
# ----------


def test_node_cordon_after_rising_gpu_temperature_is_a_planned_migration() -> None:
    c = run(
        ev(K.NODE_CORDON, EventSource.KUBERNETES, detail="cordoned: GPU temperature rising"),
        lost=(),
    )
    assert c.category == Category.PLANNED and c.qualifying
    assert c.reason.startswith(ROW_TITLE[Category.PLANNED])


def test_node_cordon_for_security_patching_is_a_planned_migration() -> None:
    c = run(ev(K.NODE_CORDON, EventSource.KUBERNETES, detail="security patching"), lost=())
    assert c.category == Category.PLANNED and c.qualifying


def test_slurm_drain_is_a_planned_migration() -> None:
    c = run(
        ev(K.NODE_DRAIN, EventSource.SLURM, scheduler="slurm", detail="reason=maintenance"), lost=()
    )
    assert c.category == Category.PLANNED and c.qualifying


def test_a_drain_of_node_0_under_slurm_is_still_planned() -> None:
    """node-2 is the batch host. A drain of it is planned: it keeps running while its ranks move."""
    drain = ev(K.NODE_DRAIN, EventSource.SLURM, slots=(0, 1), scheduler="slurm")
    c = run(drain, lost=(), batch_host="node-2")
    assert c.category == Category.PLANNED and c.qualifying
    # As the job confirms it: the moving slots are the ones that get new processes (found on a real
    # Slurm drain of the first node, which was disqualified as a node 0 failure).
    c = run(drain, lost=(0, 1), batch_host="node-2")
    assert c.category == Category.PLANNED and c.qualifying, c.reason
    c = run(drain, ev(K.PROCESS_EXIT, slots=(0,)), lost=(0, 1), batch_host="node-2")
    # then it failed mid-drain
    assert c.category == Category.UNABLE_TO_RECOVER and "node 0" in c.reason


def test_a_cordon_with_the_temperature_reading_behind_it_still_qualifies() -> None:
    c = run(
        ev(K.NODE_CORDON, EventSource.KUBERNETES), ev(K.GPU_TEMPERATURE, EventSource.NVML), lost=()
    )
    assert c.qualifying and c.category == Category.HOST_GPU_FABRIC


# --- Qualifying: job, process or training execution interruption
# --------------------------------------


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param(K.POD_DELETED, id="pod delete"),
        pytest.param(K.PROCESS_EXIT, id="process terminates"),
        pytest.param(K.KERNEL_PANIC, id="kernel panic"),
        pytest.param(K.HANG, id="NCCL hang / stuck rank"),
        pytest.param(K.NCCL_ERROR, id="NCCL error"),
        pytest.param(K.COLLECTIVE_TIMEOUT, id="NCCL timeout, every rank alive"),
        pytest.param(K.OOM_KILL, id="OOM kill"),
        pytest.param(K.CUDA_ERROR, id="CUDA driver fault"),
    ],
)
def test_execution_interruptions_qualify(kind: FailureKind) -> None:
    c = run(ev(kind))
    assert c.category == Category.INTERRUPTION and c.qualifying
    assert c.reason.startswith(ROW_TITLE[Category.INTERRUPTION]) and kind.value in c.reason


def test_a_stuck_rank_seen_as_hang_and_lost_heartbeat_is_named_hang() -> None:
    evidence = (ev(K.HEARTBEAT_LOST), ev(K.HANG))
    assert run(*evidence).category == Category.INTERRUPTION
    assert primary_kind(evidence) == K.HANG


# --- Qualifying: host, GPU or local fabric failure
# ------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "xid"),
    [
        pytest.param(K.GPU_FELL_OFF_BUS, 79, id="GPU falls off the bus"),
        pytest.param(K.GPU_ECC_UNCORRECTABLE, 48, id="uncorrectable HBM ECC"),
        pytest.param(K.NVLINK_ERROR, 74, id="NVLink failure"),
        pytest.param(K.NIC_ERROR, None, id="NIC failure"),
        pytest.param(K.GPU_LOST, None, id="GPU lost"),
        pytest.param(K.NODE_POWER_LOSS, None, id="node power loss"),
        pytest.param(K.NODE_FAILURE, None, id="entire node failure"),
        pytest.param(K.NODE_NOT_READY, None, id="node NotReady"),
    ],
)
def test_host_gpu_and_local_fabric_failures_qualify(kind: FailureKind, xid: int | None) -> None:
    c = run(ev(kind, EventSource.NVML, xid=xid))
    assert c.category == Category.HOST_GPU_FABRIC and c.qualifying
    assert c.reason.startswith(ROW_TITLE[Category.HOST_GPU_FABRIC])


def test_a_node_power_loss_outranks_the_connection_losses_and_exits_it_causes() -> None:
    evidence = (
        ev(K.CONNECTION_LOST),
        ev(K.PROCESS_EXIT),
        ev(K.NODE_POWER_LOSS, EventSource.KUBERNETES),
    )
    c = run(*evidence)
    assert c.category == Category.HOST_GPU_FABRIC and c.qualifying
    assert primary_kind(evidence) == K.NODE_POWER_LOSS


# --- Disqualifying: shared infrastructure failure
# -------------------------------------------------------


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param(K.FABRIC_OUTAGE, id="switch / fabric-wide outage"),
        pytest.param(K.FILESYSTEM_UNMOUNTED, id="filesystem unmount"),
        pytest.param(K.FILESYSTEM_FULL, id="filesystem full"),
        pytest.param(K.HOST_MEMORY_EXHAUSTED, id="not enough memory"),
    ],
)
def test_shared_infrastructure_failures_disqualify(kind: FailureKind) -> None:
    c = run(ev(kind), ev(K.PROCESS_EXIT))
    assert c.category == Category.SHARED_INFRASTRUCTURE and not c.qualifying
    assert c.reason.startswith(ROW_TITLE[Category.SHARED_INFRASTRUCTURE]) and kind.value in c.reason


# --- Disqualifying: unable to recover
# -------------------------------------------------------------------


def test_failures_exceeding_parallelism_redundancy_are_unable_to_recover() -> None:
    c = run(ev(K.NODE_POWER_LOSS, slots=(0, 1)), world=4, redundancy=2)
    assert c.category == Category.UNABLE_TO_RECOVER and not c.qualifying
    assert "exceeding parallelism redundancy" in c.reason


def test_a_failure_within_redundancy_qualifies() -> None:
    c = run(ev(K.NODE_POWER_LOSS, slots=(2, 3)), world=4, redundancy=4)
    assert c.category == Category.HOST_GPU_FABRIC and c.qualifying


HSDP = {0: "shard-a", 1: "shard-b", 2: "shard-a", 3: "shard-b"}  # 2 replicas of each of 2 shards


def test_losing_every_replica_of_a_shard_is_unable_to_recover() -> None:
    inp = ClassifyInput(
        evidence=(ev(K.NODE_POWER_LOSS, slots=(0, 2)),),
        lost_slots=(0, 2),
        world_size=4,
        redundancy=2,
        shard_of=HSDP,
    )
    c = classify(inp)
    assert c.category == Category.UNABLE_TO_RECOVER and "shard(s) shard-a" in c.reason
    assert c.kind == K.NODE_POWER_LOSS


def test_losing_one_replica_of_each_shard_qualifies() -> None:
    """The same two ranks lost as by the count rule's worst case, but each shard keeps a replica."""
    inp = ClassifyInput(
        evidence=(ev(K.NODE_POWER_LOSS, slots=(0, 1)),),
        lost_slots=(0, 1),
        world_size=4,
        redundancy=2,
        shard_of=HSDP,
    )
    assert classify(inp).qualifying


def test_a_sharded_job_without_replicas_is_unable_to_recover_after_any_loss() -> None:
    """FSDP without replica groups: every rank holds its own shard, as the ranks report it."""
    inp = ClassifyInput(
        evidence=(ev(K.PROCESS_EXIT, slots=(3,)),),
        lost_slots=(3,),
        world_size=4,
        redundancy=1,
        shard_of={s: f"shard-{s}" for s in range(4)},
    )
    assert classify(inp).category == Category.UNABLE_TO_RECOVER


def test_a_planned_move_of_a_shard_with_no_replica_qualifies_its_leaving_rank_is_the_donor() -> (
    None
):
    """The same job as above, rank 3 drained rather than killed: it stays alive to give its own
    state, so the drain is planned and qualifying. Named as a failed slot (not leaving), the same
    drain is not."""
    shards = {s: f"shard-{s}" for s in range(4)}
    drain = ev(K.NODE_DRAIN, EventSource.SLURM, slots=(3,), scheduler="slurm")
    inp = ClassifyInput(
        evidence=(drain,),
        lost_slots=(3,),
        leaving_slots=(3,),
        world_size=4,
        redundancy=1,
        shard_of=shards,
    )
    c = classify(inp)
    assert c.category == Category.PLANNED and c.qualifying, c
    c = classify(inp.model_copy(update={"leaving_slots": ()}))
    assert (
        c.category == Category.UNABLE_TO_RECOVER and "exceeding parallelism redundancy" in c.reason
    )


def test_a_failed_classifier_is_unclassified_but_qualifying() -> None:
    c = unclassified("boom")
    assert (
        c.category == Category.UNCLASSIFIED
        and c.qualifying
        and "boom" in c.reason
        and c.kind is None
    )


def test_silent_data_corruption_is_unable_to_recover() -> None:
    c = run(ev(K.SILENT_DATA_CORRUPTION), ev(K.PROCESS_EXIT))
    assert c.category == Category.UNABLE_TO_RECOVER and not c.qualifying
    assert "silent data corruption" in c.reason


def test_node_0_failure_with_slurm_is_unable_to_recover() -> None:
    """node1 is the batch host: it runs the batch script and the coordinator, Slurm ends the job
    with it."""
    c = run(
        ev(K.NODE_FAILURE, EventSource.SLURM, slots=(2,), scheduler="slurm", domain="node1"),
        batch_host="node1",
    )
    assert c.category == Category.UNABLE_TO_RECOVER and not c.qualifying
    assert "node 0" in c.reason and "Slurm" in c.reason and "node1" in c.reason


def test_node_0_lost_under_slurm_counts_even_when_no_slot_is_named() -> None:
    c = run(
        ev(K.PROCESS_EXIT, slots=()),
        ev(K.NODE_FAILURE, EventSource.SLURM, scheduler="slurm"),
        lost=(0,),
        batch_host="node-2",
    )
    assert c.category == Category.UNABLE_TO_RECOVER and "node 0" in c.reason


def test_the_node_that_ran_rank_0_is_not_special_under_slurm() -> None:
    """Slot 0's node fails, but the batch host is another node: the job goes on, rank 0 moves
    live."""
    c = run(
        ev(K.NODE_FAILURE, EventSource.SLURM, slots=(0, 1), scheduler="slurm"), batch_host="node-0"
    )
    assert c.category == Category.HOST_GPU_FABRIC and c.qualifying, c.reason


def test_node_0_failure_without_slurm_qualifies() -> None:
    c = run(ev(K.PROCESS_EXIT, slots=(0,), scheduler="kubernetes"))
    assert c.category == Category.INTERRUPTION and c.qualifying


def test_no_spare_available_is_unable_to_recover() -> None:
    c = run(ev(K.GPU_FELL_OFF_BUS, EventSource.NVML, xid=79), spare=False)
    assert c.category == Category.UNABLE_TO_RECOVER and not c.qualifying
    assert NO_SPARE_REASON in c.reason and "no spare available" in c.reason


def test_shared_infrastructure_is_named_before_unable_to_recover() -> None:
    c = run(ev(K.FILESYSTEM_FULL), ev(K.SILENT_DATA_CORRUPTION), spare=False)
    assert c.category == Category.SHARED_INFRASTRUCTURE


def test_primary_kind_of_no_evidence_is_an_error() -> None:
    with pytest.raises(ValueError):
        primary_kind(())


# --- Properties
# ------------------------------------------------------------------------------------------

evidences = st.builds(
    ev,
    kind=st.sampled_from(list(FailureKind)),
    source=st.sampled_from(list(EventSource)),
    slots=st.lists(st.integers(0, 7), max_size=3, unique=True).map(tuple),
    scheduler=st.sampled_from([None, "slurm", "kubernetes"]),
    domain=st.sampled_from(["node-0", "node-1"]),
    at=st.integers(0, 100),
)
inputs = st.builds(
    lambda evidence, lost, redundancy, spare: ClassifyInput(
        evidence=tuple(evidence),
        lost_slots=lost,
        world_size=8,
        redundancy=redundancy,
        spare_available=spare,
    ),
    st.lists(evidences, min_size=1, max_size=6),
    st.lists(st.integers(0, 7), max_size=4, unique=True).map(tuple),
    st.integers(1, 8),
    st.booleans(),
)


@given(inputs, st.sampled_from(SHARED))
def test_adding_shared_infrastructure_evidence_always_disqualifies(
    inp: ClassifyInput, kind: FailureKind
) -> None:
    c = classify(inp.model_copy(update={"evidence": (*inp.evidence, ev(kind))}))
    assert c.category == Category.SHARED_INFRASTRUCTURE and not c.qualifying


@given(inputs, st.randoms())
def test_classification_does_not_depend_on_evidence_order(
    inp: ClassifyInput, rnd: random.Random
) -> None:
    shuffled = list(inp.evidence)
    rnd.shuffle(shuffled)
    again = inp.model_copy(
        update={"evidence": tuple(reversed(shuffled)), "lost_slots": inp.lost_slots[::-1]}
    )
    assert classify(again) == classify(inp)
    assert primary_kind(again.evidence) == primary_kind(inp.evidence)


@given(inputs)
def test_qualifying_matches_the_category_and_the_reason_names_the_row(inp: ClassifyInput) -> None:
    c = classify(inp)
    assert c.qualifying == (c.category in QUALIFYING_CATEGORIES)
    assert c.reason.startswith(ROW_TITLE[c.category])
    assert ("(qualifying)" in c.reason) == c.qualifying


@given(inputs)
def test_without_a_spare_nothing_qualifies(inp: ClassifyInput) -> None:
    assert not classify(inp.model_copy(update={"spare_available": False})).qualifying


@given(inputs)
def test_the_primary_kind_belongs_to_the_category_unless_recovery_is_impossible(
    inp: ClassifyInput,
) -> None:
    c = classify(inp)
    if c.category is not Category.UNABLE_TO_RECOVER:
        assert CATEGORY_OF[primary_kind(inp.evidence)] is c.category


def test_a_failure_of_a_job_without_the_agent_is_not_configured_for_live_migration() -> None:
    """The brief's "failures on jobs that are not configured to use TorchPass": recorded,
    disqualifying, so such a job's restarts never count against the guarantee, nor as live
    migrations; the reason says what would have made it live."""
    inp = ClassifyInput(
        evidence=(ev(K.PROCESS_EXIT),), lost_slots=(2,), world_size=4, redundancy=4, agent=False
    )
    c = classify(inp)
    assert c.category is Category.UNABLE_TO_RECOVER and not c.qualifying
    assert NO_AGENT_REASON in c.reason and "live migration" in c.reason
    assert classify(inp.model_copy(update={"agent": True})).qualifying
