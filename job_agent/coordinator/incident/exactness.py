"""Whether a recovery left the job where a run that never failed would be: what makes a migration
inexact although every byte of the state moved bitwise.

Each rank's state carried from step to step (an RNN's hidden state, a batch drawn ahead) is its own:
no replica holds it. Declared (`RankAgent.carry`), the ranks name it in their layout; undeclared, a
rank that fed its model a tensor the model returned in an earlier step said so (`wire.Carries`,
kept by slot in `Roster.carries`), and a rank that did a step again after a peer's loss said whether
its model got the inputs of the step's first try (`wire.Redone`). A recovery is inexact when a rank
whose process was replaced carried such state, or when a redone step started from other inputs.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta

from job_agent.coordinator.members import Member, Roster
from job_agent.coordinator.waiting import Changes
from job_agent.wire.operator import MemberState
from torchpass.incident.steps import TransferProof

# How long a recovery waits for the verdicts of the ranks doing a step again: given at the redone
# step's first forward (or first collective, or end), they come well within a step.
VERDICT_WAIT = timedelta(seconds=30)


def redoing(ranks: list[Member], resume: int) -> list[Member]:
    """The ranks that do step `resume` again (they froze with it in flight)."""
    return [m for m in ranks if m.redo == resume]


async def verdicts(changes: Changes, ranks: list[Member], resume: int) -> None:
    """Wait, bounded, for every rank doing step `resume` again to give its verdict. A rank lost
    meanwhile gives none, nor one frozen again (a peer lost in the redone step: that is the next
    recovery's), nor one past the step without a word (the verdict comes before the step's end, if
    at all)."""

    def given(m: Member) -> bool:
        if m.redone is not None and m.redone.k == resume:
            return True
        done = (MemberState.DONE, MemberState.FROZEN)
        return not m.alive or m.state in done or m.step > resume

    with contextlib.suppress(TimeoutError):
        await changes.wait_for(
            lambda: all(given(m) for m in redoing(ranks, resume)),
            VERDICT_WAIT,
            "the redone step's verdicts",
        )


def carried_lost(ranks: list[Member], proof: TransferProof | None) -> str | None:
    """Why the run now differs from one that never failed, when the ranks that received the state
    declared per-rank state carried across steps (`RankAgent.carry`): no replica held theirs, so
    they started it afresh. None when nothing carried was lost."""
    receivers = set(proof.receiver_slots) if proof is not None else set()
    carried = sorted(
        {n for m in ranks if m.slot in receivers and m.layout for n in m.layout.carried}
    )
    if not carried:
        return None
    return (
        f"rank(s) {sorted(receivers)} carry state from step to step that no replica holds "
        f"({', '.join(carried)}): their new processes started it afresh, so the run differs from "
        "one that never failed"
    )


def undeclared_lost(roster: Roster, proof: TransferProof | None) -> str | None:
    """Why the run differs, when a rank whose process was replaced had been seen carrying state
    from step to step that it never declared."""
    receivers = sorted(set(proof.receiver_slots) if proof is not None else set())
    seen = [roster.carries[s] for s in receivers if s in roster.carries]
    if not seen:
        return None
    return (
        f"rank(s) {receivers} carried state from step to step that the agent was not told of "
        f"({seen[0]}): their new processes started it afresh, so the run differs from one that "
        "never failed; declare it with agent.carry(...)"
    )


def redone_apart(ranks: list[Member], resume: int) -> str | None:
    """Why the run differs, when a rank did step `resume` again from other inputs to its model
    than the step's first try had."""
    apart = [
        m.redone.differs
        for m in redoing(ranks, resume)
        if m.redone is not None and m.redone.k == resume and m.redone.differs
    ]
    if not apart:
        return None
    return (
        f"{apart[0]}{f' (and {len(apart) - 1} more rank(s))' if len(apart) > 1 else ''}: the run "
        "differs from one that never failed; declare that state with agent.carry(...), or pass the "
        "data to agent.steps(data=...)"
    )


def inexact(roster: Roster, proof: TransferProof | None, resume: int) -> str | None:
    """Every reason the recovery that resumed at `resume` left the job elsewhere than a run that
    never failed, in one sentence; None when it did not."""
    ranks = roster.ranks()
    reasons = [
        why
        for why in (
            carried_lost(ranks, proof),
            undeclared_lost(roster, proof),
            redone_apart(ranks, resume),
        )
        if why
    ]
    return "; ".join(reasons) or None
