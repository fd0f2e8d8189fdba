"""What the confirm step checks before the job answers: a reported failure against the job's own
view (`refutes`), a run at the job's own incident id against what the job lost (`disowns`), and the
word of the lost processes' nodes, waited for (`settle`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta

from job_agent.coordinator.incident.lifecycle import Driver, Incident
from job_agent.coordinator.members import Roster
from job_agent.coordinator.node_launcher import NodeLauncher
from job_agent.coordinator.waiting import Changes
from job_agent.launch.launcher import Launcher
from torchpass.incident.classify import CATEGORY_OF
from torchpass.models import Category, EventSource, Evidence, FailureKind

# Beyond the hang timeout, before frozen ranks with nobody lost count as a failed collective (the
# detector), and before a claim's named ranks must have shown progress (`refutes`).
STALL_MARGIN = timedelta(seconds=0.5)
# The longest confirm waits for the lost processes' nodes and for evidence on its way to the
# workflow.
SETTLE = timedelta(seconds=2)


async def refutes(
    roster: Roster, changes: Changes, evidence: Sequence[Evidence], wait: timedelta
) -> str | None:
    """Why the job's own view contradicts a reported failure: every rank it names (naming none, for
    a collective timeout, every rank) is connected and makes progress within `wait` of the report's
    arrival (the caller makes `wait` at least the job's hang timeout, so that a rank is never taken
    for lost on a claim alone while the job itself would still call it healthy). None when the claim
    may be true: a named rank is gone or dies meanwhile, or does not progress within `wait`; or when
    it names no failure (a planned drain moves healthy ranks)."""
    claims = [ev for ev in evidence if CATEGORY_OF[ev.kind] is not Category.PLANNED]
    ranks = {m.slot: m for m in roster.ranks()}
    named = {s for ev in claims for s in ev.slots}
    if not named and any(ev.kind is FailureKind.COLLECTIVE_TIMEOUT for ev in claims):
        named = set(ranks)
    if not named or any(s not in ranks or not ranks[s].alive for s in named):
        return None
    since = changes.clock.monotonic()
    try:
        await changes.wait_for(
            lambda: (
                any(not ranks[s].alive for s in named)
                or all(ranks[s].last_progress > since for s in named)
            ),
            wait,
            "the reported ranks to show progress",
        )
    except TimeoutError:
        return None
    if any(not ranks[s].alive for s in named):
        return None
    steps = ", ".join(f"{s}: step {ranks[s].step}" for s in sorted(named))
    return (
        f"refuted by the job: rank(s) {sorted(named)} connected and progressing after it ({steps})"
    )


async def disowns(
    job_id: str,
    own: Sequence[Evidence],
    lost: set[int],
    claims: Sequence[Evidence],
    signed: Callable[[Evidence], bool],
    changes: Changes,
    wait: timedelta,
) -> str | None:
    """Why a workflow run at the id of the job's own incident, started by somebody else with
    `claims`, is not that incident (a squatter's): a claim of another job, a planned move not signed
    with the job's secret, a claim naming no rank of a kind the job did not see, or ranks the job
    has not lost itself within `wait` of the check (a genuine other source reporting the same
    failure names what the job lost, or is about to: its ranks' exits may reach the job a moment
    later). None when the claims agree."""
    for ev in claims:
        if ev.job_id != job_id:
            return f"it reports a failure of job {ev.job_id!r}"
        if CATEGORY_OF[ev.kind] is Category.PLANNED and not signed(ev):
            return (
                f"it claims a planned move of rank(s) {list(ev.slots)} not signed with the job's "
                "secret"
            )
        if not ev.slots and all(o.kind is not ev.kind for o in own):
            return f"it claims a {ev.kind.value} the job did not see"
    named = {s for ev in claims for s in ev.slots}
    try:
        await changes.wait_for(lambda: named <= lost, wait, "the claimed ranks to be lost")
    except TimeoutError:
        return f"it claims rank(s) {sorted(named - lost)} failed, which the job has not lost"
    return None


async def settle(inc: Incident, lost: Iterable[str], launcher: Launcher, changes: Changes) -> None:
    """Before the job answers confirm (whose answer the classification follows): what the lost
    processes' nodes said as they reaped them (a node says an OOM kill before the exit) and, when a
    host condition joined the incident, that evidence delivered to the workflow. Bounded by
    `SETTLE`; a job without node agents, or an incident no condition joined, waits for nothing (a
    slower confirm lets the next failure fold into this incident)."""
    if not isinstance(launcher, NodeLauncher):
        return
    agents = tuple(lost)
    with contextlib.suppress(TimeoutError):
        await changes.wait_for(
            lambda: all(launcher.poll(a) is not None for a in agents), SETTLE, "exits"
        )
    pending = set(inc.deliveries)
    if (
        pending
        and inc.driver is not Driver.JOB
        and any(e.source is EventSource.NODE_AGENT for e in inc.evidence)
    ):
        await asyncio.wait(pending, timeout=SETTLE.total_seconds())
