"""Pure decisions of a recovery: who donates the state, who must receive it, how redundant the job
is."""

from __future__ import annotations

from collections.abc import Mapping


def choose_donor(
    completed: Mapping[int, int], exclude: frozenset[int] = frozenset()
) -> tuple[int, int]:
    """(donor slot, target step): a survivor holding the most advanced completed step, lowest slot
    first.

    In data parallelism every replica holds the same state after a completed step, so the most
    advanced one is right for everybody: nobody rolls back and nothing completed is recomputed.
    """
    candidates = {s: k for s, k in completed.items() if s not in exclude}
    if not candidates:
        raise ValueError("no surviving replica to take state from")
    target = max(candidates.values())
    return min(s for s, k in candidates.items() if k == target), target


def receivers(completed: Mapping[int, int], target: int, new_slots: frozenset[int]) -> list[int]:
    """Slots that must receive the donor's state: the newcomers and any survivor left behind."""
    behind = {s for s, k in completed.items() if k < target}
    return sorted(behind | set(new_slots))


def redundancy(shards: dict[int, str], world_size: int) -> int:
    """Replicas of the least replicated shard, from what the ranks reported holding; a rank that
    reported nothing is a shard of its own (never assumed to be a replica)."""
    counts: dict[str, int] = {}
    for slot in range(world_size):
        key = shards.get(slot, f"unreported-rank-{slot}")
        counts[key] = counts.get(key, 0) + 1
    return min(counts.values(), default=0)
