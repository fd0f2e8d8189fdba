"""The replicas compared while the job trains: each rank's own digest at a checked step, compared
within its shard by the coordinator; the odd one out is silent data corruption, named, and an even
split names all."""

from __future__ import annotations

from job_agent import wire
from job_agent.coordinator.detect.replicas import MAX_OPEN_STEPS, ReplicaChecks
from job_agent.coordinator.members import Member, Roster
from torchpass.incident.classify import SDC_REASON, classify, resyncs, unable_to_recover
from torchpass.incident.decisions import RecoveryAction, plan_recovery
from torchpass.incident.steps import ConfirmResult
from torchpass.models import ClassifyInput, Evidence, FailureKind

A, B, C = "a" * 64, "b" * 64, "c" * 64


def _checks(shards: list[str]) -> tuple[ReplicaChecks, list[Evidence]]:
    roster = Roster()
    for slot, shard in enumerate(shards):
        m = Member(agent_id=f"r{slot}", role=wire.Role.RANK, slot=slot, pid=slot, node=f"n{slot}")
        roster.members[m.agent_id] = m
        roster.record_layout(m, wire.ShardLayout(shard=shard, parallelism="data_parallel"))
    found: list[Evidence] = []
    return ReplicaChecks("job", len(shards), roster, found.append), found


def test_replicas_that_agree_report_nothing_and_a_step_not_checked_is_ignored() -> None:
    checks, found = _checks(["s"] * 4)
    for slot in range(4):
        checks.reported(slot, 10, A)
        checks.reported(slot, 11, None)
    assert not found


def test_the_odd_replica_is_named_once_every_rank_reported() -> None:
    checks, found = _checks(["s"] * 4)
    for slot, digest in ((0, A), (1, A), (2, B)):
        checks.reported(slot, 10, digest)
    assert not found  # rank 3 has not said yet
    checks.reported(3, 10, A)
    (ev,) = found
    assert (
        ev.kind is FailureKind.SILENT_DATA_CORRUPTION
        and ev.slots == (2,)
        and ev.failure_domain == "n2"
    )
    assert "after step 9" in ev.detail


def test_the_odd_replica_stays_a_failure_while_its_process_holds_the_slot() -> None:
    """Found while another incident still ran, the evidence waits behind it; then it is dropped only
    if the slot's process changed meanwhile (a live process at the slot is no repair of a corrupted
    one: it was dropped as repaired, and the corruption went on to the job's end)."""
    checks, found = _checks(["s"] * 4)
    for slot, digest in ((0, A), (1, A), (2, B), (3, A)):
        checks.reported(slot, 10, digest)
    (ev,) = found
    roster = checks.roster
    assert not roster.repaired(ev)
    old = roster.members.pop("r2")
    new = Member(agent_id="spare-1", role=wire.Role.RANK, slot=2, pid=9, node=old.node)
    roster.members[new.agent_id] = new
    assert roster.repaired(ev)


def test_shards_are_compared_within_their_replicas_and_an_even_split_names_all() -> None:
    checks, found = _checks(["x", "y", "x", "y"])
    for slot, digest in ((0, A), (1, B), (2, A), (3, C)):  # x agrees; y split 1:1, no majority
        checks.reported(slot, 20, digest)
    (ev,) = found
    assert ev.slots == (1, 3)


def test_a_rank_that_never_reports_leaves_a_bounded_trail() -> None:
    checks, found = _checks(["s"] * 2)
    for step in range(1, 10 * MAX_OPEN_STEPS):
        checks.reported(0, step, A)
    assert not found and len(checks._steps) <= MAX_OPEN_STEPS
    checks.reported(5, 1, B)  # not a slot of this job
    assert not found


def _confirm(lost: tuple[int, ...]) -> ConfirmResult:
    return ConfirmResult(
        confirmed=True,
        lost_slots=lost,
        fenced_slots=lost,
        world_size=4,
        redundancy=4,
        generation=1,
        covered=False,
    )


def test_corruption_with_a_majority_is_disqualified_but_rebuilt_live() -> None:
    checks, found = _checks(["s"] * 4)
    for slot, digest in ((0, A), (1, B), (2, A), (3, A)):
        checks.reported(slot, 10, digest)
    inp = ClassifyInput(evidence=tuple(found), lost_slots=(1,), world_size=4, redundancy=4)
    c = classify(inp)
    assert not c.qualifying and SDC_REASON in c.reason and "rank(s) 1" in c.reason
    assert resyncs(c)
    assert plan_recovery(c, _confirm((1,)), resync=True) is RecoveryAction.MIGRATE
    # a history from before the patch
    assert plan_recovery(c, _confirm((1,))) is RecoveryAction.FALLBACK


def test_corruption_of_every_replica_is_not_rebuilt_from_them() -> None:
    checks, found = _checks(["x", "x", "y", "y"])
    for slot, digest in ((0, A), (1, B), (2, C), (3, C)):
        checks.reported(slot, 10, digest)
    (ev,) = found
    shards = {0: "x", 1: "x", 2: "y", 3: "y"}
    inp = ClassifyInput(
        evidence=(ev,), lost_slots=ev.slots, world_size=4, redundancy=2, shard_of=shards
    )
    c = classify(inp)
    assert "exceeding parallelism redundancy" in c.reason and not resyncs(c)
    assert not resyncs(unable_to_recover("no spare available"))
