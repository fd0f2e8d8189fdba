"""Failure detection: what the coordinator sees of its members, turned into evidence for an
incident.

- lost: a member's connection closed; its exit status (or a device error it reported first) names
  it;
- hung: a rank silent past the hang timeout, or absent from a collective its peers have waited in;
- stalled: ranks frozen with nobody lost, i.e. a collective failed or timed out with every rank
  alive.

(The other way round, a failure someone else reports that the job's own view contradicts, is the
confirm step's: `incident/claims.py`.)

Each returns `Evidence` and decides nothing else: the incident's workflow does.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

from job_agent import wire
from job_agent.coordinator.clock import SYSTEM, Clock
from job_agent.coordinator.detect.hangs import Progress, find_hung
from job_agent.coordinator.incident.claims import STALL_MARGIN
from job_agent.coordinator.members import Member, Roster
from job_agent.launch.launcher import signal_name
from job_agent.wire.operator import MemberState
from torchpass.models import EventSource, Evidence, FailureKind

# Nodes holding ranks lost within this window, half the job's or more (two at least), are one outage
# of what they share (a switch, the fabric), not host failures.
FABRIC_WINDOW = timedelta(seconds=30)


class Detector:
    def __init__(
        self, job_id: str, roster: Roster, hang_timeout: timedelta, clock: Clock = SYSTEM
    ) -> None:
        self._clock = clock
        self._job_id = job_id
        self._roster = roster
        self._hang = hang_timeout
        self._nodes_lost: dict[str, float] = {}  # node -> when (monotonic), within FABRIC_WINDOW

    def _evidence(self, m: Member, kind: FailureKind, detail: str, **kw: object) -> Evidence:
        fields: dict[str, object] = {
            "kind": kind,
            "source": EventSource.COORDINATOR,
            "job_id": self._job_id,
            "failure_domain": m.node,
            "slots": (m.slot,),
            "detail": detail,
            **kw,
        }
        return Evidence.model_validate(fields)

    def lost(self, m: Member, code: int | None, reason: str, observed: float) -> Evidence:
        """A rank's connection closed at wall time `observed`; `code` is its exit status if it
        ended."""
        at = datetime.fromtimestamp(observed, UTC)
        device = m.device_error
        if device is not None:
            return self._evidence(
                m, FailureKind.CUDA_ERROR, device.detail, observed_at=at, exit_code=code
            )
        if code is not None:
            detail = f"rank {m.slot} ({m.agent_id}) {signal_name(code)}"
            return self._evidence(
                m, FailureKind.PROCESS_EXIT, detail, observed_at=at, exit_code=code
            )
        detail = f"rank {m.slot} connection lost: {reason}"
        return self._evidence(m, FailureKind.CONNECTION_LOST, detail, observed_at=at)

    def node_lost(
        self,
        node: str,
        observed: float,
        world_size: int,
        why: str = "its agent's connection closed",
    ) -> Evidence | None:
        """A node agent's connection closed at wall time `observed`: the node failed, taking the
        slots it held (None when it held none: a spare node's loss only costs its spares)."""
        homes = {s: self._roster.home(s) for s in range(world_size)}
        slots = tuple(s for s, n in homes.items() if n == node)
        if not slots:
            return None
        now = self._clock.monotonic()
        self._nodes_lost = {
            n: t for n, t in self._nodes_lost.items() if now - t < FABRIC_WINDOW.total_seconds()
        }
        self._nodes_lost[node] = now
        kind, detail = (
            FailureKind.NODE_FAILURE,
            f"node {node} lost: {why} ({len(slots)} rank(s) on it)",
        )
        held = {n for n in homes.values() if n is not None} | set(self._nodes_lost)
        if len(self._nodes_lost) >= 2 and 2 * len(self._nodes_lost) >= len(held):
            # Half the job's nodes or more gone within seconds: not one host's failure but what they
            # share (a switch, the fabric, their power): the brief's shared-infrastructure row.
            kind = FailureKind.FABRIC_OUTAGE
            detail += (
                f"; {len(self._nodes_lost)} of the job's {len(held)} nodes lost within"
                f" {FABRIC_WINDOW.total_seconds():.0f} s ({', '.join(sorted(self._nodes_lost))}):"
                " a fabric-wide outage"
            )
        return Evidence(
            kind=kind,
            source=EventSource.COORDINATOR,
            job_id=self._job_id,
            failure_domain=node,
            slots=slots,
            detail=detail,
            observed_at=datetime.fromtimestamp(observed, UTC),
        )

    def gpu(self, node: str, report: wire.GpuReport) -> tuple[Evidence | None, list[Member]]:
        """A node's GPU report, checked against the job's own view: the evidence for those of the
        named processes that are training ranks on that node (none: nothing to do), and those ranks.
        A warning is a planned move (the ranks freeze at a step boundary, then leave); a failure,
        evidence of the GPU's kind."""
        ranks = [
            m
            for a in report.agent_ids
            if (m := self._roster.members.get(a)) is not None
            and m.slot >= 0
            and m.alive
            and not (m.fenced or m.leaving)
            if m.node == node
        ]
        if not ranks:
            return None, []
        slots = tuple(sorted(m.slot for m in ranks))
        kind = FailureKind.NODE_DRAIN if report.planned else report.kind
        what = "moved off pre-emptively" if report.planned else "lost with it"
        return Evidence(
            kind=kind,
            source=EventSource.NVML,
            job_id=self._job_id,
            failure_domain=node,
            slots=slots,
            detail=f"node {node}: {report.detail}; rank(s) {list(slots)} {what}",
            observed_at=self._clock.now(),
            xid=report.xid,
        ), ranks

    def hung(self, now: float) -> list[Evidence]:
        """Training ranks that are hung, each with the time it last made progress."""
        training = [m for m in self._roster.ranks(MemberState.TRAINING) if not m.fenced]
        progress = [
            Progress(
                m.slot,
                m.last_heartbeat,
                m.collective_step,
                m.collective_at,
                # busy, or yet to reach its first collective
                m.busy is not None or m.collective_step < 0,
            )
            for m in training
        ]
        out = []
        for hang in find_hung(progress, now, self._hang.total_seconds()):
            m = self._roster.at(hang.slot)
            if m is None:
                continue
            # A silent rank's last sign of life is its heartbeat; a rank that still heart-beats but
            # never came to the collective last progressed when it entered its last step or
            # collective.
            last = min(m.last_heartbeat, m.last_progress) if hang.silent else m.last_progress
            out.append(
                self._evidence(
                    m,
                    FailureKind.HANG,
                    f"rank {m.slot} hung: {hang.detail}",
                    observed_at=self._clock.now(),
                    last_progress_at=self._clock.as_wall(last),
                )
            )
        return out

    def silent(self, now: float, members: Sequence[Member]) -> list[tuple[Member, Evidence | None]]:
        """Members not heard from at all (not even a heartbeat) for the hang timeout: stopped or
        wedged. Each with its hang evidence when it holds a slot (a spare not yet given one is only
        replaced)."""
        out: list[tuple[Member, Evidence | None]] = []
        for m in members:
            if not m.alive or m.fenced or now - m.last_heartbeat <= self._hang.total_seconds():
                continue
            detail = f"{m.agent_id} silent for {now - m.last_heartbeat:.1f} s during a recovery"
            at = self._clock.as_wall(m.last_heartbeat)
            ev = None
            if m.slot >= 0:
                ev = self._evidence(
                    m, FailureKind.HANG, detail, observed_at=self._clock.now(), last_progress_at=at
                )
            out.append((m, ev))
        return out

    def stalled(self, now: float, world_size: int) -> Evidence | None:
        """Ranks frozen with nobody lost: a collective failed or timed out with every rank alive.

        Reported once every rank of the world is frozen (nobody died: a dead rank is never
        "frozen"), or when some have been frozen past the hang timeout while the rest still
        heart-beat in a collective of their own. A real loss or hang is detected well within that
        time and takes precedence.
        """
        ranks = self._roster.ranks()
        frozen = [m for m in ranks if m.state is MemberState.FROZEN and m.frozen_at is not None]
        if not frozen:
            return None
        everyone = len(ranks) == world_size and len(frozen) == len(ranks)
        first = min(m.frozen_at for m in frozen if m.frozen_at is not None)
        waited = now - first
        if not everyone and waited <= (self._hang + STALL_MARGIN).total_seconds():
            return None
        return Evidence(
            kind=FailureKind.COLLECTIVE_TIMEOUT,
            source=EventSource.COORDINATOR,
            job_id=self._job_id,
            failure_domain="collective",
            slots=(),
            detail=f"ranks {sorted(m.slot for m in frozen)} left a failed collective with every "
            f"rank alive ({len(frozen)} of {world_size} frozen for {waited:.1f} s); re-forming the "
            "group in place",
            observed_at=self._clock.as_wall(first),
        )
