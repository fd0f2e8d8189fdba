"""Evidence that comes while an incident's world is already decided waits for the next incident, and
keeps the process it concerned (`Roster.repaired`): a GPU report about a rank that has not died
yet stands while that rank holds its slot. Before, it was dropped as "repaired" when the recovery
ended, because its slot's process was alive (it was the very process the report was about). The
real coordinator against in-process fake ranks over the real protocol."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from job_agent.coordinator.incident.lifecycle import IncidentState
from job_agent.coordinator.incident.tracker import IncidentTracker
from tests.unit.job_driver import Counts, Job, Migration
from torchpass.incident.steps import IncidentRef, RejoinResult
from torchpass.models import Disposition, EventSource, Evidence, FailureKind


async def test_a_gpu_report_about_a_live_rank_waits_and_is_the_next_incident(
    tmp_path: Path, allowance: Counts
) -> None:
    job = Job(tmp_path, allowance, nproc=4, spares=2)
    job.launcher.fail_at(2, 5)
    job.launcher.step_seconds = 0.2
    async with job:
        rejoin = job.steps.rejoin
        ecc = Evidence(
            kind=FailureKind.GPU_ECC_UNCORRECTABLE,
            source=EventSource.NVML,
            job_id=job.spec.job_id,
            failure_domain="gpu-node-0",
            slots=(0,),
            detail="XID 48 on rank 0's GPU",
            observed_at=datetime.now(UTC),
        )

        async def rejoin_then_report(ref: IncidentRef) -> RejoinResult:
            result = await rejoin(ref)
            # The world trains again, the incident not yet recorded: the next one takes it.
            inc = job.coordinator.incidents.current
            assert inc is not None and inc.state is IncidentState.TRAINING
            job.coordinator.add_evidence(ecc)  # rank 0 is alive: its GPU is failing
            assert [e for e, _ in job.coordinator.incidents.queued] == [ecc]
            return result

        job.steps.rejoin = rejoin_then_report  # type: ignore[method-assign]
        first = Migration(job, *await job.report())
        assert (await first.run()).disposition is Disposition.MIGRATED
        job.steps.rejoin = rejoin  # type: ignore[method-assign]
        workflow_id, report = await job.report()  # the next incident: the GPU report stood
        assert report.evidence == ecc and workflow_id != first.ref.workflow_id
        outcome = await Migration(job, workflow_id, report).run()
        assert outcome.disposition is Disposition.MIGRATED and outcome.lost_slots == (0,)
        await job.finished()


async def test_a_late_report_of_the_incidents_own_loss_concerns_no_live_process() -> None:
    """The other side: a report of the lost rank arriving after the spare took its slot is about
    the process already replaced, not the spare now there (or the spare would be the next
    incident, fenced healthy)."""
    tracker = IncidentTracker("job-a", lambda: 0, _never, None)
    tracker.holders = lambda ev: tuple(f"now-{s}" for s in ev.slots)
    inc = tracker.add(_lost(2))
    assert inc is not None
    inc.lost.add(2)
    inc.move(IncidentState.FREEZING)
    inc.move(IncidentState.FROZEN)
    inc.move(IncidentState.MOVED)
    inc.move(IncidentState.TRAINING)  # the spare trains in slot 2: the world is decided
    assert tracker.add(_lost(2)) is None and tracker.add(_lost(0)) is None
    assert [(e.slots, held) for e, held in tracker.queued] == [((2,), ()), ((0,), ("now-0",))]
    tracker.cancel()


async def _never(workflow_id: str, report: object) -> None:
    raise ConnectionError("no Temporal in this test")


def _lost(slot: int) -> Evidence:
    return Evidence(
        kind=FailureKind.PROCESS_EXIT,
        source=EventSource.COORDINATOR,
        job_id="job-a",
        failure_domain=f"vm/rank{slot}",
        slots=(slot,),
        observed_at=datetime.now(UTC),
    )
