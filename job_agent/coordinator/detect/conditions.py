"""What the node agents say of their hosts (`wire.HostReport`), as evidence of the failures it
explains.

A watched filesystem full or unmounted, a host out of memory, a process OOM-killed: on its own none
of these is a failure of the job (a full disk matters only to the step that writes to it), so a
report starts no incident. It is kept, per node, while it holds and for `WINDOW` after it ended (an
OOM kill frees the memory it was about), and it joins the evidence of a failure of that node's ranks
that it can explain: a process that exited or was cut off, a hang, a failed collective. A GPU that
fell off the bus or a node that lost power is not explained by a full disk; those stay what they
are.

Either order works: a rank's exit heard first, then the node's report (the node reads its counters
as it reaps the process), or the other way round. Each condition joins an incident once, and only
before the incident is frozen (its classification is made by then).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from job_agent import wire
from job_agent.coordinator.incident.tracker import IncidentTracker
from job_agent.coordinator.members import Roster
from job_agent.coordinator.node_launcher import NodeLauncher
from torchpass.models import EventSource, Evidence, FailureKind

K = FailureKind
WINDOW = timedelta(seconds=10)
MAX_NODES = 1024
MAX_PER_NODE = 32
# The failures a host condition can explain: the process died, stopped answering, or stalled.
EXPLAINED = frozenset(
    {
        K.PROCESS_EXIT,
        K.CONNECTION_LOST,
        K.HEARTBEAT_LOST,
        K.HANG,
        K.COLLECTIVE_TIMEOUT,
        K.OOM_KILL,
    }
)


@dataclass
class _Condition:
    report: wire.HostReport
    since: datetime
    slots: tuple[int, ...]  # of the process it names (an OOM kill); () for the whole node
    ended: float | None = None  # monotonic


class HostConditions:
    """Per node, the conditions its agent reported that still hold or ended within `WINDOW`."""

    def __init__(
        self, job_id: str, roster: Roster, incidents: IncidentTracker, nodes: NodeLauncher | None
    ) -> None:
        if nodes is not None:
            nodes.on_host = self.heard  # what the job's node agents say of their hosts
        self._job_id = job_id
        self._roster = roster
        self._incidents = incidents
        self._nodes: OrderedDict[str, dict[tuple[FailureKind, str], _Condition]] = OrderedDict()
        self._incident = ""  # the incident the conditions below joined
        self._joined: set[tuple[str, FailureKind, str]] = set()  # (node, kind, key)

    def heard(self, node: str, report: wire.HostReport) -> None:
        """Keep `report`; it joins the incident now in progress if that incident lost ranks on
        `node` (to a failure it can explain) and is not frozen yet."""
        key = (report.kind, report.path or ",".join(report.agent_ids))
        held = self._nodes.setdefault(node, {})
        self._nodes.move_to_end(node)
        if report.active:
            slots = tuple(
                sorted(
                    m.slot
                    for a in report.agent_ids
                    if (m := self._roster.members.get(a)) and m.slot >= 0
                )
            )
            held[key] = _Condition(report, datetime.now(UTC), slots)
        elif key in held:
            held[key].ended = time.monotonic()
        self._bound(held)
        inc = self._incidents.current
        if inc is None or inc.past_freeze or key not in held:
            return
        explained = [e for e in inc.evidence if e.failure_domain == node and e.kind in EXPLAINED]
        lost = tuple(sorted({s for e in explained for s in e.slots}))
        for ev in self._join(inc.workflow_id, node, {key: held[key]}, lost) if explained else ():
            self._incidents.add(ev)

    def explaining(self, ev: Evidence) -> list[Evidence]:
        """The conditions of `ev`'s node that may explain it (none for a failure they cannot
        explain)."""
        held = self._nodes.get(ev.failure_domain)
        inc = self._incidents.current
        if ev.kind not in EXPLAINED or not held or inc is None or inc.past_freeze:
            return []
        return self._join(inc.workflow_id, ev.failure_domain, held, ev.slots)

    def _join(
        self,
        incident: str,
        node: str,
        conditions: dict[tuple[FailureKind, str], _Condition],
        slots: tuple[int, ...],
    ) -> list[Evidence]:
        if incident != self._incident:
            self._incident, self._joined = incident, set()
        now, out = time.monotonic(), []
        for (kind, key), c in conditions.items():
            fresh = c.ended is None or now - c.ended < WINDOW.total_seconds()
            mine = not c.slots or set(c.slots) & set(slots)
            if not fresh or not mine or (node, kind, key) in self._joined:
                continue
            self._joined.add((node, kind, key))
            state = "" if c.ended is None else " (since ended)"
            out.append(
                Evidence(
                    kind=kind,
                    source=EventSource.NODE_AGENT,
                    job_id=self._job_id,
                    failure_domain=node,
                    slots=c.slots or slots,
                    detail=f"node {node}: {c.report.detail}{state}",
                    observed_at=c.since,
                )
            )
        return out

    def _bound(self, held: dict[tuple[FailureKind, str], _Condition]) -> None:
        now = time.monotonic()
        for key in [
            k for k, c in held.items() if c.ended and now - c.ended > WINDOW.total_seconds()
        ]:
            del held[key]
        while len(held) > MAX_PER_NODE:
            del held[next(iter(held))]
        while len(self._nodes) > MAX_NODES:
            self._nodes.popitem(last=False)
