"""Who is hung, a pure decision on what the coordinator knows of each rank's liveness and
progress."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Progress:
    """What the coordinator knows of one training rank's liveness and progress."""

    slot: int
    last_heartbeat: float
    collective_step: int = -1
    collective_at: float = 0.0
    excused: bool = False  # busy (`agent.busy`), or not yet at its first collective since it joined


@dataclass(frozen=True)
class Hang:
    slot: int
    detail: str
    silent: bool  # no heartbeat at all (stopped process), rather than absent from a collective


def find_hung(ranks: list[Progress], now: float, timeout: float) -> list[Hang]:
    """Ranks that are hung: silent for `timeout`, or not in a collective their peers wait in.

    A stopped process (SIGSTOP, a frozen node) stops heart-beating. A rank stuck in its own code or
    a device kernel still heart-beats but never enters the collective every peer has been waiting
    in.
    """
    hung = [
        Hang(r.slot, f"no heartbeat for {now - r.last_heartbeat:.1f} s", silent=True)
        for r in ranks
        if now - r.last_heartbeat > timeout
    ]
    if hung or len(ranks) < 2:
        return hung
    front = max(r.collective_step for r in ranks)
    waiting = [r for r in ranks if r.collective_step == front]
    # A rank that said it is busy (rank-0-only evaluation, saving), or is still in its first step
    # since it joined (a cold start: compilation, a spare's first step), is late, not hung: the
    # peers' collective timeout bounds that wait.
    behind = [r for r in ranks if r.collective_step < front and not r.excused]
    if not behind or front < 0:
        return []
    waited = now - max(r.collective_at for r in waiting)
    if waited <= timeout:
        return []
    return [
        Hang(
            r.slot,
            f"peers have waited {waited:.1f} s in the collective of step {front}; this rank never "
            "came",
            silent=False,
        )
        for r in behind
    ]
