"""The delivery of an incident's reports (`job_agent.coordinator.incident.tracker.IncidentTracker`):
the report of the evidence that names the incident's workflow is delivered first, whatever the
others do, so the workflow is started by it and its id is the one the ledger's check derives from
its start input (`torchpass.contract.verify`). Two ranks lost at once, the first report slow to
reach Temporal, used to start the workflow with the second's."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

from job_agent.coordinator.incident.tracker import IncidentTracker
from torchpass.contract.verify import failure_key
from torchpass.models import EventSource, Evidence, FailureKind, FailureReport


def lost(domain: str, slot: int) -> Evidence:
    return Evidence(
        kind=FailureKind.PROCESS_EXIT,
        source=EventSource.COORDINATOR,
        job_id="job-a",
        failure_domain=domain,
        slots=(slot,),
        observed_at=datetime.now(UTC),
    )


async def test_the_report_that_names_the_workflow_is_delivered_first() -> None:
    delivered: list[tuple[str, FailureReport]] = []
    failures = {"vm/rank1": 2}  # the first report fails twice before it gets through

    async def reporter(workflow_id: str, report: FailureReport) -> None:
        domain = report.evidence.failure_domain
        if failures.get(domain, 0) > 0:
            failures[domain] -= 1
            raise ConnectionError("Temporal away")
        delivered.append((workflow_id, report))

    tracker = IncidentTracker("job-a", lambda: 7, reporter, None, retry_for=timedelta(seconds=10))
    inc = tracker.add(lost("vm/rank1", 1))
    assert inc is not None and tracker.add(lost("vm/rank2", 2)) is inc
    for _ in range(100):
        if len(delivered) == 2:
            break
        await asyncio.sleep(0.05)
    assert [r.evidence.failure_domain for _, r in delivered] == ["vm/rank1", "vm/rank2"]
    (wf, first), _ = delivered
    assert wf == inc.workflow_id == failure_key(first)
    tracker.cancel()


async def test_a_report_never_delivered_does_not_hold_the_others_back_for_ever() -> None:
    delivered: list[str] = []

    async def reporter(workflow_id: str, report: FailureReport) -> None:
        if report.evidence.failure_domain == "vm/rank1":
            raise ConnectionError("refused")
        delivered.append(report.evidence.failure_domain)

    tracker = IncidentTracker("job-a", lambda: 0, reporter, None, retry_for=timedelta(seconds=0.5))
    tracker.add(lost("vm/rank1", 1))
    tracker.add(lost("vm/rank2", 2))
    for _ in range(100):
        if delivered:
            break
        await asyncio.sleep(0.05)
    assert delivered == ["vm/rank2"] and tracker.undelivered == 1
    tracker.cancel()
