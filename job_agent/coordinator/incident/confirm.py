"""The confirm step: the job fences what it lost and measures what a recovery needs; and which of
the job's incidents a step's reference names.

A failure the job did not detect itself is a claim, checked against the job's own view
(`claims.py`): refuted when every rank it names keeps making progress, refused when it is an
unsigned planned move. A run at the id of the job's own incident that somebody else started is that
incident only if its claims agree with what the job lost; otherwise the incident moves to a fresh
id.
"""

from __future__ import annotations

import time
from datetime import timedelta

from job_agent.coordinator.incident.claims import STALL_MARGIN, disowns, refutes, settle
from job_agent.coordinator.incident.donors import redundancy
from job_agent.coordinator.incident.job_control import JobControl, work_seconds
from job_agent.coordinator.incident.lifecycle import Driver, Incident, IncidentError
from torchpass.errors import ErrorType
from torchpass.incident.classify import leaving_slots, planned
from torchpass.incident.steps import ConfirmResult, IncidentRef
from torchpass.models import Evidence, FailureKind

FENCE_TIMEOUT = timedelta(seconds=10)
# A failure reported by another source (or forged) names ranks the job still sees: they must show no
# progress for this long before they are fenced (`claims.refutes`).
REFUTE_WAIT = timedelta(seconds=5)


def is_current(job: JobControl, ref: IncidentRef) -> bool:
    """Whether `ref` names the incident the job itself has open."""
    inc = job.incidents.current
    return inc is not None and inc.workflow_id == ref.workflow_id


def incident_of(job: JobControl, ref: IncidentRef, evidence: tuple[Evidence, ...] = ()) -> Incident:
    """The incident a step acts for; one reported by another source is adopted, with `evidence`."""
    workflow_id = ref.workflow_id
    inc = job.incidents.current
    if inc is not None and is_current(job, ref):
        return inc
    if inc is None and evidence:
        # Reported by another source (a node watch, NVML): adopt it as this job's incident.
        for ev in evidence:
            job.incidents.add(ev)
        inc = job.incidents.current
        if inc is not None:
            inc.workflow_id = workflow_id
            inc.drive(Driver.WORKFLOW)  # its workflow drives it: the job never takes it over
            return inc
    raise IncidentError(
        ErrorType.UNKNOWN_INCIDENT, f"job {job.job_id} has no incident {workflow_id}"
    )


async def confirm(
    job: JobControl, ref: IncidentRef, evidence: tuple[Evidence, ...]
) -> ConfirmResult:
    """The job fences what is lost and answers with what it measures (`ConfirmResult`). A failure it
    did not detect itself is a claim: refuted by its own view, or refused unsigned (a planned move);
    a run at its own incident's id that somebody else started is refused unless its claims agree."""
    t0 = time.perf_counter()
    inc = job.incidents.current
    if inc is not None and is_current(job, ref) and evidence and evidence[0] not in inc.evidence:
        # A run at the id of the job's own incident that somebody else started: the same failure
        # seen first by another source, or a squatter holding the id with a claim of its own.
        claims = [ev for ev in evidence if ev not in inc.evidence]
        why = await disowns(
            job.job_id, inc.evidence, inc.lost, claims, job.signed, job.changes, REFUTE_WAIT
        )
        if why is not None:
            reason = f"run {ref.incident_id} is not this job's incident: {why}"
            moved = job.incidents.rekey(inc, reason)
            return _result(
                job, False, (), (), f"refused by the job: {why}; its incident is {moved}", t0
            )
    if not is_current(job, ref):
        # Not an incident the job detected itself: a claim, checked against the job's own view. A
        # planned move of healthy ranks cannot be checked that way: it must be signed.
        unsigned = [ev for ev in evidence if planned(ev) and not job.signed(ev)]
        if unsigned:
            slots = sorted({s for ev in unsigned for s in ev.slots})
            why = (
                f"refused by the job: a planned move of rank(s) {slots}, not signed with its secret"
            )
            return _result(job, False, (), (), why, t0)
        # As long as the job's own hang detection takes: a claim stands only where the job sees it
        # too.
        wait = max(REFUTE_WAIT, job.hang_timeout + STALL_MARGIN)
        refuted = await refutes(job.roster, job.changes, evidence, wait)
        if refuted is not None:
            return _result(job, False, (), (), refuted, t0)
    inc = incident_of(job, ref, evidence)
    inc.leaving |= leaving_slots(inc.evidence)
    fenced = []
    for slot in sorted(inc.lost - inc.leaving):
        for m in list(job.roster.members.values()):
            # Still running (hung), or its connection lost while its process lives on: fence it so
            # it can never rejoin (killing one that already exited does nothing).
            if m.slot == slot and (m.alive or not m.fenced):
                job.fence(m)
        fenced.append(slot)
    gone = inc.lost - inc.leaving
    await job.changes.wait_for(
        lambda: all(job.roster.at(s) is None for s in gone), FENCE_TIMEOUT, "fenced ranks to die"
    )
    dead = [m.agent_id for m in job.roster.members.values() if m.slot in gone and not m.alive]
    await settle(inc, dead, job.launcher, job.changes)  # a node's word on why they died, delivered
    # Nobody lost but a collective failed with every rank alive: the group re-forms in place.
    confirmed = bool(inc.lost) or any(
        ev.kind is FailureKind.COLLECTIVE_TIMEOUT for ev in inc.evidence
    )
    detail = "; ".join(ev.detail for ev in inc.evidence)
    inc.confirmed = frozenset(inc.lost)
    # still healthy: each its own donor
    leaving = tuple(sorted(leaving_slots(inc.evidence) & inc.lost))
    return _result(job, confirmed, tuple(sorted(inc.lost)), tuple(fenced), detail, t0, leaving)


def _result(
    job: JobControl,
    confirmed: bool,
    lost: tuple[int, ...],
    fenced: tuple[int, ...],
    detail: str,
    t0: float,
    leaving: tuple[int, ...] = (),
) -> ConfirmResult:
    shards = dict(job.roster.shards)
    return ConfirmResult(
        confirmed=confirmed,
        lost_slots=lost,
        fenced_slots=fenced,
        world_size=job.world_size,
        redundancy=redundancy(shards, job.world_size),
        shard_of=shards,
        spares_ready=len(job.spares.ready()),
        spares_warming=job.spares.warming(),
        generation=job.generation,
        covered=job.covered,
        agent=job.spec.agent,
        leaving_slots=leaving,
        batch_host=job.spec.batch_host,
        detail=detail,
        work_seconds=work_seconds(t0),
    )
