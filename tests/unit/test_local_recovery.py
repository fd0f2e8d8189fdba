"""The job never waits on the control plane: with Temporal away, the job carries an incident out
itself.

The real coordinator over fake ranks (`job_driver.Job`), its reports failing as they do while the
server is down. On the previous main the survivors stayed frozen until Temporal came back (minutes,
once), and the incident was then booked as a disqualified "no spare" failure.
"""

from __future__ import annotations

import asyncio
import os
from datetime import UTC, datetime
from pathlib import Path

import pytest

from job_agent.coordinator import coordinator
from tests.unit.fake_ranks import digest_of
from tests.unit.job_driver import STEPS, Counts, Job, Migration, until
from torchpass.ids import incident_workflow_id
from torchpass.incident.proof import filed_ending
from torchpass.incident.steps import FreezeResult, IncidentRef
from torchpass.job import JobState
from torchpass.models import Disposition, EventSource, Evidence, FailureKind, FailureReport
from torchpass.signing import sign


def _records(job: Job) -> list[Path]:
    folder = job.spec.job_dir / "local"
    return sorted(folder.iterdir()) if folder.exists() else []


async def test_with_temporal_down_the_job_recovers_by_itself_and_its_record_is_filed_once(
    tmp_path: Path, allowance: Counts
) -> None:
    """A rank killed while no report can reach Temporal: past the wait, the job runs the steps
    itself (the spare takes the slot, nothing recomputed), keeps the record (owner-only) and keeps
    reporting. When Temporal is back its workflow is refused the steps and files the record; it
    replaces the job's provisional outcome, the file goes, and a retried filing records nothing
    twice; a completion that disagrees with the record (here forged) is not taken."""
    job = Job(tmp_path, allowance, nproc=4, local=True)
    job.down = True
    job.launcher.fail_at(2, 5)
    async with job:
        c = job.coordinator
        await until(lambda: len(c.incidents.outcomes) == 1, "the job to recover by itself")
        (local,) = c.incidents.outcomes
        assert local.handled_locally and local.disposition is Disposition.MIGRATED and local.success
        assert local.kind is FailureKind.PROCESS_EXIT and local.lost_slots == (2,)
        assert (
            local.steps_recomputed == 0 and local.proof is not None and local.proof.step_after == 4
        )
        # every rank trains again, Temporal away
        assert local.resumed_steps == dict.fromkeys(range(4), 5)
        assert c.generation == 1 and c.state in (JobState.TRAINING, JobState.FINISHED)
        workflow_id = local.incident_id.removesuffix("/local")
        (path,) = _records(job)
        assert os.stat(path).st_mode & 0o777 == 0o600
        tried = job.attempts
        await until(lambda: job.attempts > tried, "the report to be tried again")
        # Temporal is back: the report gets through and starts the incident's workflow
        job.down = False
        delivered, report = await job.report()
        assert delivered == workflow_id and report.evidence.slots == (2,)
        assert not c.incidents.answered(workflow_id)  # its steps are refused (HandledLocally) ...
        record = await c.incidents.records.record_of(workflow_id)  # ... it files the record instead
        assert record.workflow_id == workflow_id and record.confirm is not None
        # the workflow's own check holds
        assert filed_ending(record).disposition is Disposition.MIGRATED
        forged = {
            "incident_id": f"{workflow_id}/run-0",
            "disposition": Disposition.FAILED,
            "success": False,
        }
        run0 = IncidentRef(workflow_id=workflow_id, run_id="run-0", job_id=c.job_id)
        await job.steps.complete(run0, local.model_copy(update=forged))  # not what the record says
        assert c.incidents.outcomes == [local] and len(_records(job)) == 1  # not taken
        run1 = IncidentRef(workflow_id=workflow_id, run_id="run-1", job_id=c.job_id)
        filed = local.model_copy(update={"incident_id": run1.incident_id})
        await job.steps.complete(run1, filed)
        await job.steps.complete(run1, filed)  # a retried completion
        assert c.incidents.outcomes == [filed] and _records(job) == []
        await job.finished()
    r = job.result
    assert r is not None and r.status is JobState.FINISHED and r.incidents == (filed,)
    assert (r.steps_completed, r.final_digest, r.steps_recomputed) == (
        STEPS,
        digest_of(STEPS - 1),
        0,
    )
    assert r.incidents_unfiled == 0 and r.reports_undelivered == 0


async def test_a_record_never_filed_stays_in_the_state_directory_and_is_counted(
    tmp_path: Path, allowance: Counts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Temporal never comes back before the job ends: the job finishes anyway, says how many
    incidents were never filed, and their records stay in its local/ directory for an operator to
    file."""
    monkeypatch.setattr(coordinator, "FILE_WAIT", coordinator.timedelta(seconds=0.5))
    job = Job(tmp_path, allowance, nproc=3, local=True)
    job.down = True
    job.launcher.fail_at(1, 4)
    async with job:
        await job.finished()
    r = job.result
    assert (
        r is not None and r.status is JobState.FINISHED and r.final_digest == digest_of(STEPS - 1)
    )
    assert r.incidents_unfiled == 1 and [o.handled_locally for o in r.incidents] == [True]
    (path,) = _records(job)
    assert r.incidents[0].incident_id.removesuffix("/local").split(":")[0] in path.name


async def test_an_incident_adopted_from_another_sources_report_stays_its_workflows(
    tmp_path: Path, allowance: Counts
) -> None:
    """A signed drain reported by another source (a node watch) is adopted by its workflow's
    confirm: a step reached the job, so however long the workflow then takes between steps, the job
    never carries the incident out itself as well."""
    job = Job(tmp_path, allowance, local=True)
    job.launcher.step_seconds = 0.3  # still training when the slow workflow freezes it
    async with job:
        c = job.coordinator
        await until(lambda: all(m.step >= 2 for m in c.roster.ranks()), "the ranks to train")
        victim = c.roster.at(1)
        assert victim is not None
        ev = Evidence(
            kind=FailureKind.NODE_DRAIN,
            source=EventSource.KUBERNETES,
            job_id=c.job_id,
            failure_domain=victim.node,
            slots=(1,),
            observed_at=datetime.now(UTC),
        )
        freeze = job.steps.freeze

        async def slow_freeze(ref: IncidentRef) -> FreezeResult:
            await asyncio.sleep(3 * job.spec.control_plane_wait)  # a slow control worker
            return await freeze(ref)

        job.steps.freeze = slow_freeze  # type: ignore[method-assign]
        report = FailureReport(
            evidence=sign(c._secret, ev), job_task_queue="q", generation=c.generation
        )
        m = Migration(job, incident_workflow_id(c.job_id, victim.node, c.generation), report)
        outcome = await m.run()
        assert outcome.disposition is Disposition.MIGRATED and not c.incidents.records.handled
        await job.finished()
    r = job.result
    assert (
        r is not None and [o.handled_locally for o in r.incidents] == [False] and not _records(job)
    )
