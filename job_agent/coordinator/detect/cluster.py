"""What a cluster detector says of a node (`wire.NodeEvent`), checked against the job's own view.

A detector (`workers.detectors.kube`, `workers.detectors.slurm`) watches the scheduler and tells
each job what happened to a node: cordoned or set to DRAIN (move the work off while it still runs),
NotReady, DOWN or FAIL, or the job's pod on it deleted. That is a claim; the job decides what it
means for itself:

- a node with none of the job's ranks concerns it only so far as no spare of the job there is used
  any more, and nothing starts;
- a planned signal moves every rank on the node off, to spares on other nodes, at a step boundary
  (the brief's planned migration);
- a failure is taken for one only when the job's own view agrees: the node's agent (or, without node
  agents, its ranks) unheard for `QUIET`. Then its ranks are fenced and killed, and the evidence is
  of the cluster's kind (NotReady, DOWN, pod deleted). A node the job still hears from is not lost,
  whatever the scheduler thinks (a kubelet cut off from the API server, a Slurm controller that lost
  touch): its ranks are moved off as a planned move, while they work, and the evidence says why.

Every observation has a key. Heard again (a restarted detector re-reads the same state, a watch
resumes over an event already delivered) it starts nothing: the keys heard are kept, bounded, and a
move already made leaves no rank on the node to move.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from job_agent import wire
from job_agent.coordinator.incident.tracker import IncidentTracker
from job_agent.coordinator.members import Member, Roster
from job_agent.coordinator.node_launcher import NodeLauncher
from job_agent.launch.launcher import Launcher
from job_agent.wire.operator import CLUSTER_PLANNED
from torchpass.models import EventSource, Evidence, FailureKind

QUIET = timedelta(seconds=2)  # a node agent beats every 0.5 s, a rank every second
MAX_KEYS = 4096


class ClusterSignals:
    """The nodes the cluster took away from the job, and what it said of them."""

    def __init__(
        self,
        job_id: str,
        roster: Roster,
        launcher: Launcher,
        avoid: set[str],
        incidents: IncidentTracker,
        add: Callable[[Evidence], None],
    ) -> None:
        self._job_id = job_id
        self._add = add
        self.training: Callable[[], bool] = lambda: True  # set by the coordinator
        self._roster = roster
        self._incidents = incidents
        self.quiet = QUIET.total_seconds()
        self._launcher = launcher
        self._nodes = launcher if isinstance(launcher, NodeLauncher) else None
        # shared with the spare pool and the node launcher: nothing new goes there
        self.avoid = avoid
        self._heard: OrderedDict[str, str] = OrderedDict()

    def heard(self, ev: wire.NodeEvent, state: str) -> tuple[wire.Ok | wire.Error, Evidence | None]:
        """The answer to a detector, and the evidence to act on (None: nothing starts)."""
        key = f"{ev.source}:{ev.key}"
        if key in self._heard:
            return _nothing(f"already heard: {self._heard[key]}"), None
        self.avoid.add(ev.node)
        ranks = [m for m in self._roster.ranks() if m.node == ev.node and not m.fenced]
        if ranks and state != "training":  # not heard: the detector's next resync says it again
            return _nothing(f"job {self._job_id} is {state}: not yet"), None
        self._remember(key, f"{ev.kind.value} of {ev.node}")
        if ev.kind not in CLUSTER_PLANNED and self._answers(
            ev.node, ranks, time.monotonic() - self.quiet
        ):
            # The job heard from the node a moment ago: it decides once it has listened for `quiet`
            # (a power loss is seen here within that time; a node that still talks is not lost).
            asyncio.get_running_loop().call_later(self.quiet, self._recheck, ev, time.monotonic())
            return _nothing(f"checking: job {self._job_id} heard from {ev.node} just now"), None
        return self._decide(ev, ranks, lost=ev.kind not in CLUSTER_PLANNED)

    def _recheck(self, ev: wire.NodeEvent, claimed: float) -> None:
        ranks = [m for m in self._roster.ranks() if m.node == ev.node and not m.fenced]
        if ranks and not self.training():
            return  # the job ended (or restarts) meanwhile: its ranks are its own business now
        lost = not self._answers(ev.node, ranks, claimed)
        _, evidence = self._decide(ev, ranks, lost, "" if lost else "; the job still hears from it")
        if evidence is not None:
            self._add(evidence)

    def _decide(
        self, ev: wire.NodeEvent, ranks: list[Member], lost: bool, why: str = ""
    ) -> tuple[wire.Ok, Evidence | None]:
        """The ranks on the node failed with it (fenced, killed), or move off while they work."""
        if not ranks:
            return self._of_incident(ev)
        slots = tuple(m.slot for m in ranks)
        kind = ev.kind if lost or ev.kind in CLUSTER_PLANNED else FailureKind.NODE_DRAIN
        for m in ranks if lost else ():
            m.fenced = True  # its loss is this evidence, not another when its connection closes
            self._launcher.kill(m.agent_id)
        evidence = self._evidence(ev, kind, slots, "lost with it" if lost else "moved off", why)
        what = "failed" if lost else "moving"
        return wire.Ok(
            detail={"acted": True, "slots": list(slots), "kind": kind.value, "ranks": what}
        ), evidence

    def _of_incident(self, ev: wire.NodeEvent) -> tuple[wire.Ok, Evidence | None]:
        """A node with no rank left: one more piece of evidence of the incident that lost its ranks
        (a power loss seen first as the ranks' exits, then as NotReady); if that failure's outcome
        is recorded already, a late report into its history (its workflow lingers for it); else
        nothing."""
        inc = self._incidents.current
        slots = sorted(
            {s for e in inc.evidence if e.failure_domain == ev.node for s in e.slots} if inc else ()
        )
        # a cordon after the node failed is no news of the failure
        failed = ev.kind not in CLUSTER_PLANNED
        if (
            (inc is None or not slots)
            and failed
            and (done := self._incidents.recent(ev.node)) is not None
        ):
            late = self._evidence(ev, ev.kind, done.lost_slots, "lost with it, already replaced")
            self._incidents.late(late, done.incident_id)
            detail = {
                "acted": True,
                "slots": list(done.lost_slots),
                "kind": ev.kind.value,
                "late": True,
            }
            return wire.Ok(detail={**detail, "incident": done.incident_id}), None
        if inc is None or not slots:
            return _nothing(f"no rank of job {self._job_id} runs on {ev.node}"), None
        evidence = self._evidence(ev, ev.kind, tuple(slots), "lost with it")
        return wire.Ok(
            detail={
                "acted": True,
                "slots": slots,
                "kind": ev.kind.value,
                "incident": inc.workflow_id,
            }
        ), evidence

    def _evidence(
        self,
        ev: wire.NodeEvent,
        kind: FailureKind,
        slots: tuple[int, ...],
        what: str,
        why: str = "",
    ) -> Evidence:
        said = f"{ev.source}: node {ev.node} {ev.kind.value}" + (
            f" ({ev.reason})" if ev.reason else ""
        )
        return Evidence(
            kind=kind,
            source=EventSource(ev.source),
            job_id=self._job_id,
            failure_domain=ev.node,
            slots=slots,
            detail=f"{said}{why}; rank(s) {list(slots)} {what}",
            observed_at=ev.observed_at,
            scheduler=ev.source,
        )

    def _answers(self, node: str, ranks: list[Member], since: float) -> bool:
        """Whether the job heard from `node` after `since` (monotonic): its agent, or (ranks started
        by the coordinator itself) its ranks."""
        if self._nodes is not None:
            n = self._nodes.nodes.get(node)
            return n is not None and n.alive and n.last_heard > since
        return any(m.last_heartbeat > since for m in ranks)

    def _remember(self, key: str, what: str) -> None:
        self._heard[key] = f"{what} at {datetime.now(UTC).isoformat(timespec='seconds')}"
        while len(self._heard) > MAX_KEYS:
            self._heard.popitem(last=False)


def _nothing(why: str) -> wire.Ok:
    return wire.Ok(detail={"acted": False, "why": why})
