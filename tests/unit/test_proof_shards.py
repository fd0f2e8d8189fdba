"""The proof of a recovery that moved several shards (an HSDP job that lost one rank of each of two
shards): each receiver must hold its own donor's state, the donors of one shard must agree, and
donors of different shards hold different states by design. A proof of one shard reads as before."""

from __future__ import annotations

from torchpass.incident.proof import transfer_problems
from torchpass.incident.steps import ReceiverProof, TransferProof

X, Y, Z = "x" * 64, "y" * 64, "z" * 64


def _proof(
    installed: dict[int, str], donors: dict[int, str], shards: dict[int, str]
) -> TransferProof:
    donor_of = {0: 2, 1: 3}  # lost ranks 0 and 1 of a 2 x 2 mesh, from the other replica group
    return TransferProof(
        donor_slot=3,
        receiver_slots=(0, 1),
        donor_digest=donors[3],
        receiver_digests=installed,
        step_before=9,
        step_after=9,
        donor_step=9,
        bytes=10,
        seconds=0.1,
        receivers=tuple(
            ReceiverProof(slot=s, stream_digest=d, installed_digest=d, installed_step=9, bytes=5)
            for s, d in installed.items()
        ),
        donor_of=donor_of,
        donor_digests=donors,
        donor_shards=shards,
    )


def test_two_shards_each_from_its_own_replica_hold() -> None:
    assert transfer_problems(_proof({0: X, 1: Y}, {2: X, 3: Y}, {2: "a", 3: "b"}), 9) == []


def test_a_receiver_holding_the_other_shards_state_fails() -> None:
    problems = transfer_problems(_proof({0: Y, 1: Y}, {2: X, 3: Y}, {2: "a", 3: "b"}), 9)
    assert any("rank 0 holds state hashing to" in p for p in problems), problems


def test_without_shards_every_donor_must_hold_one_state_as_before() -> None:
    problems = transfer_problems(_proof({0: X, 1: Y}, {2: X, 3: Y}, {}), 9)
    assert any("the replicas differ" in p for p in problems), problems


def test_two_donors_of_one_shard_that_differ_fail() -> None:
    proof = _proof({0: X, 1: Y}, {2: X, 3: Y}, {2: "a", 3: "b"}).model_copy(
        update={"donor_digests": {2: X, 3: Y, 4: Z}, "donor_shards": {2: "a", 3: "b", 4: "a"}}
    )
    problems = transfer_problems(proof, 9)
    assert problems == [
        f"donor rank 4 holds state hashing to {Z[:16]}, the donor's is {X[:16]}: the replicas "
        "differ"
    ]


def test_a_receiver_served_another_shard_than_its_slot_holds_fails() -> None:
    """Each receiver holds exactly what its donor sent, but rank 0's slot holds shard "a" and its
    donor served shard "b": the bytes agree with themselves, not with the job's layout."""
    proof = _proof({0: X, 1: Y}, {2: X, 3: Y}, {2: "b", 3: "b"}).model_copy(
        update={"receiver_shards": {0: "a", 1: "b"}}
    )
    problems = transfer_problems(proof, 9)
    assert any(
        "rank 0 holds shard 'a', its donor rank 2 served shard 'b'" in p for p in problems
    ), problems
    right = proof.model_copy(update={"donor_shards": {2: "a", 3: "b"}})
    assert transfer_problems(right, 9) == []
