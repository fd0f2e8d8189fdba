"""The replicas compared: silent divergence and data corruption found while the job trains.

At the steps the job checks (every `verify_every` steps, and right after each recovery's redone
step) every rank reports the digest of the state it holds as it enters the step
(`wire.Step.digest`). Once all ranks reported one step, the coordinator compares them within each
shard: ranks holding the same shard must hold the same bytes. A rank that differs from the majority
of its shard's replicas is evidence of its own kind (silent data corruption, the brief's "Unable to
recover" row, so never counted), and the recovery that follows fences it and rebuilds its state from
the majority, live. A shard whose replicas split with no majority has no state to trust: all of them
are named, and with no replica left the job restarts from its checkpoint.

The comparison is the coordinator's, from each rank's own report: no rank judges another.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime

from job_agent.coordinator.members import Roster
from torchpass.models import EventSource, Evidence, FailureKind

# steps some rank has not reported yet (a lost rank never will): the oldest dropped
MAX_OPEN_STEPS = 8


class ReplicaChecks:
    def __init__(
        self, job_id: str, world_size: int, roster: Roster, report: Callable[[Evidence], None]
    ) -> None:
        self.job_id, self.world_size, self.roster = job_id, world_size, roster
        self._report = report
        self._steps: dict[int, dict[int, str]] = {}

    def reported(self, slot: int, step: int, digest: str | None) -> None:
        """Rank `slot` entered `step` holding `digest` (None: not a step the job checks); a
        divergence is reported once every rank has."""
        if (
            digest is not None
            and 0 <= slot < self.world_size
            and (ev := self._compare(slot, step, digest))
        ):
            self._report(ev)

    def _compare(self, slot: int, step: int, digest: str) -> Evidence | None:
        at = self._steps.setdefault(step, {})
        at[slot] = digest  # a step done again after a recovery is reported again: the latest counts
        while len(self._steps) > MAX_OPEN_STEPS:
            del self._steps[min(self._steps)]
        if len(at) < self.world_size:
            return None
        del self._steps[step]
        odd = self.odd(at)
        if not odd:
            return None
        slots = ", ".join(map(str, odd))
        # the processes that held another state: the evidence stands while they hold it
        for s in odd:
            if (m := self.roster.at(s)) is not None:
                self.roster.suspects[s] = m.agent_id
        return Evidence(
            kind=FailureKind.SILENT_DATA_CORRUPTION,
            source=EventSource.COORDINATOR,
            job_id=self.job_id,
            failure_domain=self.roster.home(odd[0]) or "unknown",
            slots=tuple(odd),
            detail=f"rank(s) {slots} held another state than the majority of their shard's "
            f"replicas after step {step - 1} (digests {', '.join(at[s][:12] for s in odd)})",
            observed_at=datetime.now(UTC),
        )

    def odd(self, digests: dict[int, str]) -> list[int]:
        """The slots whose digest is not their shard's strict majority (all of a shard split
        evenly)."""
        shards: dict[str, dict[int, str]] = {}
        for slot, digest in digests.items():
            shards.setdefault(self.roster.shards.get(slot, f"unreported-rank-{slot}"), {})[slot] = (
                digest
            )
        out: list[int] = []
        for replicas in shards.values():
            (majority, count), *_ = Counter(replicas.values()).most_common(1)
            if count * 2 > len(replicas):
                out += [s for s, d in replicas.items() if d != majority]
            elif len(set(replicas.values())) > 1:
                out += list(replicas)
        return sorted(out)
