"""A job's end: replicas that end with different states make it fail, naming the odd ones out, where
it used to finish "ok" with no digest; shards of a sharded model are compared within their own
replicas."""

from __future__ import annotations

from job_agent import wire
from job_agent.coordinator.ending import diverged, final_digest
from job_agent.coordinator.members import Member


def _rank(slot: int, digest: str, shard: str = "s") -> Member:
    m = Member(agent_id=f"r{slot}", role=wire.Role.RANK, slot=slot, pid=slot, node="n")
    m.digest, m.layout = digest, wire.ShardLayout(shard=shard, parallelism="data_parallel")
    return m


def test_replicas_that_agree_have_not_diverged() -> None:
    assert diverged([_rank(s, "a") for s in range(4)]) is None


def test_the_odd_replica_is_named() -> None:
    why = diverged([_rank(0, "a"), _rank(1, "a"), _rank(2, "b"), _rank(3, "a")])
    assert why is not None and "rank(s) 2 differ" in why


def test_shards_are_compared_within_their_replicas() -> None:
    ranks = [_rank(0, "a", "x"), _rank(1, "b", "y"), _rank(2, "a", "x"), _rank(3, "b", "y")]
    assert diverged(ranks) is None
    ranks[3].digest = "c"
    why = diverged(ranks)
    assert (
        why is not None
        and "rank(s) 1, 3 differ" not in why
        and ("rank(s) 1" in why or "rank(s) 3" in why)
    )


def test_a_data_parallel_jobs_final_digest_is_its_replicas_one_digest() -> None:
    assert final_digest([_rank(s, "a") for s in range(4)]) == "a"
    # replicas that disagree have no one state
    assert final_digest([_rank(0, "a"), _rank(1, "b")]) is None
    assert final_digest([_rank(0, "a"), _rank(1, "")]) is None  # a rank that reported none


def test_a_sharded_jobs_final_digest_covers_every_shard_in_slot_order() -> None:
    ranks = [_rank(0, "a", "x"), _rank(1, "b", "y"), _rank(2, "a", "x"), _rank(3, "b", "y")]
    whole = final_digest(ranks)
    assert whole is not None and whole not in ("a", "b")
    assert final_digest(list(reversed(ranks))) == whole  # the slots' order, not the roster's
    ranks[3].digest = "c"
    other = final_digest(ranks)
    assert other is None  # shard y's replicas disagree
    ranks[1].digest = ranks[3].digest = "c"
    assert final_digest(ranks) not in (None, whole)  # another shard state, another digest


def test_a_rank_restored_at_the_jobs_end_came_back_when_it_said_it_was_done() -> None:
    """A restart from the checkpoint of the last step leaves the ranks nothing to train: each
    resumes by finishing, and the recovery's end is that moment (once the epoch, 1970, for want of a
    step)."""
    m = _rank(0, "")
    m.observe(wire.Done(step=-1, digest=""), now=5.0, wall=1_800_000_000.0)
    assert m.step_wall == 1_800_000_000.0
