"""A job's end: replicas that end with different states make it fail, naming the odd ones out, where it
used to finish "ok" with no digest; shards of a sharded model are compared within their own replicas."""

from __future__ import annotations

from job_agent import wire
from job_agent.ending import diverged
from job_agent.members import Member


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
    assert why is not None and "rank(s) 1, 3 differ" not in why and ("rank(s) 1" in why or "rank(s) 3" in why)
