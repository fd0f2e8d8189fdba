"""Claims the job refuted (a failure it never had, forged or mistaken: "not a failure") are kept
apart from its incidents: counted, the latest kept, never among the incidents of its result, its
incident log or its summary. A flood of them used to fill the result's `incidents`."""

from __future__ import annotations

from datetime import UTC, datetime

from job_agent.coordinator.incident.tracker import KEPT_REFUTED, IncidentTracker
from torchpass.cli.run import _summary
from torchpass.incident.outcome import MigrationOutcome
from torchpass.job import JobResult, JobState
from torchpass.models import (
    Category,
    Classification,
    Disposition,
    EventSource,
    Evidence,
    FailureKind,
    FailureReport,
)

REFUTED = Classification(category=Category.INTERRUPTION, qualifying=False, reason="refuted")
REAL = Classification(category=Category.INTERRUPTION, qualifying=True, reason="a rank died")


def outcome(n: int, disposition: Disposition = Disposition.NOT_A_FAILURE) -> MigrationOutcome:
    real = disposition is not Disposition.NOT_A_FAILURE
    return MigrationOutcome(
        incident_id=f"torchpass-incident:j:n:g{n}/run",
        job_id="j",
        failure_domain="n",
        kind=FailureKind.PROCESS_EXIT,
        evidence_count=1,
        classification=REAL if real else REFUTED,
        covered=False,
        disposition=disposition,
        success=real,
        detected_at=datetime(2026, 12, 1, tzinfo=UTC),
    )


async def _ignore(workflow_id: str, report: FailureReport) -> None:
    pass


async def test_a_flood_of_refuted_claims_is_counted_and_only_the_latest_kept() -> None:
    tracker = IncidentTracker("j", lambda: 0, _ignore, None)
    claims = [outcome(n) for n in range(KEPT_REFUTED + 10)]
    for o in claims:
        assert tracker.end(o, lambda ev, held: False, refuted=True)
    assert not tracker.end(claims[-1], lambda ev, held: False, refuted=True)  # a retried completion
    assert tracker.outcomes == []
    assert list(tracker.refuted) == claims[-KEPT_REFUTED:]
    assert tracker.refuted_total == KEPT_REFUTED + 10
    # the job's own incident is still one of its incidents
    ev = Evidence(
        kind=FailureKind.PROCESS_EXIT,
        source=EventSource.COORDINATOR,
        job_id="j",
        failure_domain="n",
        slots=(1,),
        observed_at=datetime.now(UTC),
    )
    assert tracker.add(ev) is not None
    real = outcome(99, Disposition.MIGRATED)
    assert tracker.end(real, lambda ev, held: False)
    assert tracker.outcomes == [real] and tracker.current is None
    tracker.cancel()


def test_a_result_written_before_refuted_claims_were_apart_still_reads() -> None:
    old = '{"job_id": "j", "status": "finished", "steps_completed": 3, "generation": 0}'
    r = JobResult.model_validate_json(old)
    assert (r.refuted_claims, r.refuted_claims_total) == ((), 0)


def test_the_summary_counts_refuted_claims_apart_from_the_incidents() -> None:
    real, claim = outcome(1, Disposition.MIGRATED), outcome(2)
    r = JobResult(
        job_id="j",
        status=JobState.FINISHED,
        steps_completed=3,
        generation=1,
        incidents=(real,),
        refuted_claims=(claim,),
        refuted_claims_total=7,
    )
    text = _summary(r.model_dump(mode="json"))
    assert f"incident {real.incident_id}" in text and claim.incident_id not in text
    assert "7 failure claim(s) the job refuted (not its failures; result.json: refuted_claims)" in (
        text
    )
