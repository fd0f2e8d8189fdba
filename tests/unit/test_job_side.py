"""The job side, fast: the real Coordinator and IncidentSteps against in-process fake ranks.

Each test runs a real `Coordinator` (its TCPStore, its authenticated control server, its detection
and its incident tracker) with `fake_ranks.FakeLauncher`, whose ranks are threads speaking the real
protocol, and drives `IncidentSteps` in MigrationWorkflow's order (`job_driver.Migration`).
Afterwards nothing it started is left: no fake rank running, no thread or file descriptor beyond
what a coordinator that ran and shut down still holds while referenced (its TCPStore's own), and its
shutdown returned a JobResult.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from job_agent import wire
from job_agent.coordinator.incident import confirm
from job_agent.coordinator.incident.lifecycle import IncidentError
from job_agent.coordinator.jobs import request
from job_agent.coordinator.members import Member
from job_agent.coordinator.spares import MAX_FAILED_STARTS
from job_agent.wire.rank import Role
from tests.unit.fake_ranks import KILLED, digest_of
from tests.unit.job_driver import STEPS, WAIT, Counts, Job, Migration, bounded, until
from torchpass.errors import ErrorType
from torchpass.ids import incident_workflow_id
from torchpass.incident.outcome import MigrationOutcome
from torchpass.incident.steps import IncidentRef, TransferResult
from torchpass.job import JobResult, JobState
from torchpass.models import (
    Category,
    Disposition,
    EventSource,
    Evidence,
    FailureKind,
    FailureReport,
)
from torchpass.signing import sign


def _assert_migrated_live(
    job: Job, m: Migration, outcome: MigrationOutcome, lost: int, target: int
) -> None:
    """Every figure of a live migration of slot `lost`, the world frozen after step `target`."""
    n, state = job.spec.nproc, digest_of(target)
    cf, rs, fr, tr, rj = m.confirmed, m.reserved, m.frozen, m.transferred, m.rejoined
    assert m.failed == {} and m.fallback is None and cf and rs and fr and tr and rj
    assert cf.confirmed and cf.lost_slots == cf.fenced_slots == (lost,)
    assert (cf.world_size, cf.redundancy, cf.spares_ready) == (n, n, 1)
    survivors = {s: target for s in range(n) if s != lost}
    assert fr.completed_steps == survivors and fr.target_step == fr.step_before == target
    p = tr.proof
    assert (p.donor_slot, p.donor_step, p.donor_digest) == (min(survivors), target, state)
    assert p.receiver_slots == (lost,) and p.survivor_steps == survivors
    assert p.step_before == p.step_after == target
    (r,) = p.receivers  # what the receiver computed itself of what it installed
    assert (r.slot, r.stream_digest, r.installed_digest, r.installed_step) == (
        lost,
        state,
        state,
        target,
    )
    assert rj.resumed_step == target + 1 and rj.resumed_steps == dict.fromkeys(range(n), target + 1)
    assert (
        rj.steps_recomputed == 0
        and rj.step_before == target
        and job.coordinator.progress.recomputed == set()
    )
    assert (
        outcome.success
        and outcome.disposition is Disposition.MIGRATED
        and outcome.steps_recomputed == 0
    )
    holder = job.coordinator.roster.at(lost)
    # the spare took the lost rank's place
    assert holder is not None and (holder.agent_id,) == rs.spare_ids


def _assert_finished(job: Job, incidents: int, refuted: int = 0) -> JobResult:
    """The job ran every step, and every rank holds the one same final state; `refuted` claims were
    kept apart from its `incidents`."""
    r = job.result
    assert r is not None and r.status is JobState.FINISHED, r
    assert (r.steps_completed, r.final_digest, r.error) == (STEPS, digest_of(STEPS - 1), None)
    assert len(r.incidents) == incidents and r.reports_undelivered == 0
    assert len(r.refuted_claims) == r.refuted_claims_total == refuted, r.refuted_claims
    assert {m.digest for m in job.coordinator.roster.ranks()} == {digest_of(STEPS - 1)}
    return r


async def test_a_clean_run_finishes_with_one_digest(tmp_path: Path, allowance: Counts) -> None:
    """The real coordinator against in-process fake ranks over the real protocol: nothing fails,
    nothing is reported or recomputed, and every rank ends with the same state."""
    async with Job(tmp_path, allowance) as job:
        await job.finished()
    r = _assert_finished(job, incidents=0)
    assert (r.generation, r.steps_recomputed) == (0, 0) and job.reports.empty()


async def test_a_killed_rank_is_migrated_live_and_measured(
    tmp_path: Path, allowance: Counts
) -> None:
    """The real coordinator against in-process fake ranks over the real protocol: a rank killed as
    it enters step 5 is a process exit; the spare takes its slot with the donor's state of step 4
    and every rank resumes at step 5, nothing recomputed; a new spare is started."""
    job = Job(tmp_path, allowance, nproc=4)
    job.launcher.fail_at(2, 5)
    async with job:
        workflow_id, report = await job.report()
        ev = report.evidence
        assert (ev.kind, ev.slots, ev.exit_code) == (FailureKind.PROCESS_EXIT, (2,), KILLED)
        assert (
            report.generation == 0
            and ev.detail == f"rank 2 ({ev.failure_domain[10:]}) killed by SIGKILL"
        )
        m = Migration(job, workflow_id, report)
        outcome = await m.run()
        _assert_migrated_live(job, m, outcome, lost=2, target=4)
        # refilled
        assert len(job.coordinator.spares.ready()) + job.coordinator.spares.warming() == 1
        await job.finished()
    r = _assert_finished(job, incidents=1)
    assert (r.incidents[0].incident_id, r.steps_recomputed, r.generation) == (m.incident_id, 0, 1)


async def test_a_dropped_connection_is_a_lost_connection(tmp_path: Path, allowance: Counts) -> None:
    """The real coordinator against in-process fake ranks over the real protocol: a rank whose
    connection drops while its process lives on is a lost connection; confirm kills it and the spare
    takes over."""
    job = Job(tmp_path, allowance)
    job.launcher.drop_connection_at(1, 4)
    async with job:
        workflow_id, report = await job.report()
        ev = report.evidence
        assert (ev.kind, ev.slots, ev.exit_code) == (FailureKind.CONNECTION_LOST, (1,), None)
        (dropped,) = [a for a, m in job.coordinator.roster.members.items() if m.slot == 1]
        assert job.launcher.poll(dropped) is None  # it lives on
        m = Migration(job, workflow_id, report)
        outcome = await m.run()
        assert job.launcher.poll(dropped) == KILLED
        _assert_migrated_live(job, m, outcome, lost=1, target=3)
        await job.finished()
    _assert_finished(job, incidents=1)


async def test_a_hang_is_timed_from_its_last_progress_and_fenced(
    tmp_path: Path, allowance: Counts
) -> None:
    """The real coordinator against in-process fake ranks over the real protocol: a rank stopped as
    it enters step 6 is reported as a hang, its last progress a hang timeout before; confirm kills
    it."""
    job = Job(tmp_path, allowance)
    job.launcher.hang_at(1, 6)
    async with job:
        workflow_id, report = await job.report()
        ev = report.evidence
        assert (ev.kind, ev.slots) == (FailureKind.HANG, (1,)) and ev.last_progress_at is not None
        # A hang timeout without progress (a tenth of slack: wall-clock times made from monotonic
        # ones).
        assert ev.observed_at - ev.last_progress_at >= 0.9 * timedelta(
            seconds=job.spec.hang_timeout
        )
        hung = job.coordinator.roster.at(1)
        assert hung is not None and job.launcher.poll(hung.agent_id) is None
        m = Migration(job, workflow_id, report)
        confirm = await m.confirm()
        assert (
            confirm.fenced_slots == (1,)
            and hung.fenced
            and job.launcher.poll(hung.agent_id) == KILLED
        )
        outcome = await m.run()
        _assert_migrated_live(job, m, outcome, lost=1, target=5)
        assert outcome.last_progress_at == ev.last_progress_at
        await job.finished()
    _assert_finished(job, incidents=1)


async def test_a_receiver_holding_other_bytes_fails_the_transfer(
    tmp_path: Path, allowance: Counts
) -> None:
    """The real coordinator against in-process fake ranks over the real protocol: a receiver whose
    installed state differs from the donor's by one character fails `transfer` with a proof mismatch
    naming it; the incident falls back to a restart and the job still finishes with one state."""
    job = Job(tmp_path, allowance)
    job.launcher.fail_at(1, 5)
    job.launcher.corrupt_receive(1)
    async with job:
        m = Migration(job, *(await job.report()))
        outcome = await m.run()
        e = m.failed.pop("transfer")
        assert e.error_type is ErrorType.PROOF_MISMATCH and "rank 1 holds state hashing to" in str(
            e
        )
        assert m.failed == {} and m.transferred is None and (fb := m.fallback) is not None
        assert outcome.disposition is Disposition.FALLBACK_RESTART and not outcome.success
        # no checkpoint
        assert (fb.restored_step, fb.failed_at_step, fb.steps_recomputed) == (-1, 4, 5)
        assert fb.resumed_steps == {0: 0, 1: 0, 2: 0}
        await job.finished()
    assert _assert_finished(job, incidents=1).steps_recomputed == 5


async def test_a_rank_resuming_at_another_step_fails_the_rejoin(
    tmp_path: Path, allowance: Counts
) -> None:
    """The real coordinator against in-process fake ranks over the real protocol: a rank that enters
    step 6 after the rejoin instead of step 5 fails `rejoin` with a proof mismatch naming it."""
    job = Job(tmp_path, allowance)
    job.launcher.fail_at(1, 5)
    async with job:
        m = Migration(job, *(await job.report()))
        job.launcher.resume_elsewhere(0, 1)
        outcome = await m.run()
        e = m.failed.pop("rejoin")
        assert e.error_type is ErrorType.PROOF_MISMATCH
        assert "rank 0 resumed at step 6, not at step 5" in str(e)
        assert m.failed == {} and m.transferred is not None and m.rejoined is None
        assert outcome.disposition is Disposition.FALLBACK_RESTART and not outcome.success
        await job.finished()
    _assert_finished(job, incidents=1)


async def test_no_spare_is_measured_at_confirm_and_falls_back(
    tmp_path: Path, allowance: Counts
) -> None:
    """The real coordinator against in-process fake ranks over the real protocol: with no spare,
    confirm measures none ready, reserve refuses (no spare), and the restart from the checkpoint of
    step 7 redoes exactly step 8."""
    job = Job(tmp_path, allowance, spares=0, ckpt=4)
    job.launcher.fail_at(1, 9)
    async with job:
        m = Migration(job, *(await job.report()))
        # The survivors completed step 8 with rank 1 (it died entering step 9). A survivor that had
        # no CPU yet to say so would be killed by the restart with its step 8 unsaid, and the
        # restart would rightly measure nothing redone (seen once in CI on 2 busy cores). So wait
        # until one has said so. Nothing else is waited for: the restart reads what they completed
        # once they are gone.
        await until(
            lambda: job.coordinator.progress.high_water >= 8, "a survivor to report step 8 done"
        )
        confirm = await m.confirm()
        assert confirm.confirmed and (confirm.spares_ready, confirm.spares_warming) == (0, 0)
        with pytest.raises(IncidentError) as raised:
            await bounded(job.steps.reserve(m.ref))
        assert raised.value.error_type is ErrorType.NO_SPARE
        outcome = await m.run()
        c = outcome.classification
        assert c.category is Category.UNABLE_TO_RECOVER and not c.qualifying and m.reserved is None
        assert (
            outcome.disposition is Disposition.FALLBACK_RESTART and (fb := m.fallback) is not None
        )
        assert (fb.restored_step, fb.failed_at_step, fb.steps_recomputed) == (7, 8, 1)
        assert fb.resumed_steps == {0: 8, 1: 8, 2: 8} and job.coordinator.progress.recomputed == {8}
        await job.finished()
    assert _assert_finished(job, incidents=1).steps_recomputed == 1


async def test_a_malformed_frame_gets_a_typed_error_job_goes_on(
    tmp_path: Path, allowance: Counts
) -> None:
    """The real coordinator against in-process fake ranks over the real protocol: frames that are
    not JSON, of no known kind, with a bad field, or not a member's to send are each answered with a
    typed error frame; the coordinator carries on and the job finishes as if nothing happened."""
    bad = {
        0: (b"{not json", ErrorType.BAD_FRAME),
        1: (b'{"t": "warp", "k": 1}', ErrorType.UNKNOWN_FRAME),
        2: (b'{"t": "step", "k": -1}', ErrorType.BAD_FRAME),
        3: (b'{"t": "status"}', ErrorType.UNKNOWN_FRAME),
    }
    job = Job(tmp_path, allowance, nproc=4)
    for slot, (body, _) in bad.items():
        job.launcher.malformed_at(slot, 3 + slot, body)
    async with job:
        await job.finished()
    r = _assert_finished(job, incidents=0)
    assert r.generation == 0 and job.reports.empty()
    errors = {f.slot: [e.code for e in f.errors] for f in job.launcher.fakes.values() if f.errors}
    assert errors == {slot: [code] for slot, (_, code) in bad.items()}


async def test_a_spare_starting_as_the_job_ends_is_told_to_leave(
    tmp_path: Path, allowance: Counts
) -> None:
    """The real coordinator against in-process fake ranks over the real protocol: a spare that
    connects once the job has finished (a refill still starting) is told to exit at once; the
    shutdown never waits out its grace for it."""
    job = Job(tmp_path, allowance)
    job.launcher.step_seconds = 0.05  # still training once the test is ready to see it finish
    async with job:
        c, spawned, end = job.coordinator, list[str](), job.coordinator.fail

        def fail(error: str | None, state: JobState = JobState.FAILED) -> None:
            # the spare starts as the job finishes, before the shutdown sees who is left
            end(error, state)
            if state is JobState.FINISHED and not spawned:
                spawned.append(c.spawn(Role.SPARE, -1))

        c.fail = fail  # type: ignore[method-assign]
        # Bounded by WAIT, well inside the finish grace a shutdown waiting for the spare would take.
        assert job.spec.finish_grace > 2 * WAIT
        await job.finished()
        (spare,) = spawned
    # Admitted, told to go, gone: it exited 0 of its own (one the shutdown had to stop says
    # TERMINATED).
    assert spare in c.roster.members and job.launcher.poll(spare) == 0
    _assert_finished(job, incidents=0)


async def test_a_spare_dying_at_start_is_replaced_and_the_job_goes_on(
    tmp_path: Path, allowance: Counts, caplog: pytest.LogCaptureFixture
) -> None:
    """The real coordinator against in-process fake ranks over the real protocol: two spares in a
    row die before they ever connect (a crash at import); each is replaced, never fatal, said with
    the likeliest cause (a script building something from `agent.rank`, -1 on a spare), and the
    third one takes a killed rank's slot live."""
    job = Job(tmp_path, allowance)
    job.launcher.spares_die_at_start(2)
    job.launcher.fail_at(1, 9)
    async with job:
        m = Migration(job, *(await job.report()))
        outcome = await m.run()
        assert outcome.success and outcome.disposition is Disposition.MIGRATED
        await job.finished()
    _assert_finished(job, incidents=1)
    dead = [f for f in job.launcher.fakes.values() if f.settings.role == "spare" and f.code == 1]
    assert len(dead) == 2
    said = [r.getMessage() for r in caplog.records if "before joining" in r.getMessage()]
    assert len(said) == 2 and all(
        "agent.rank is -1" in m and "starting another" in m for m in said
    ), said


async def test_spares_whose_script_fails_before_they_are_warm_stop_being_replaced(
    tmp_path: Path, allowance: Counts
) -> None:
    """The real coordinator against in-process fake ranks: every spare connects, then its script
    fails before it is warm. Each counts as a failed start: the pool stops after a bound (it
    respawned them without end before), and the job trains on to its end."""
    job = Job(tmp_path, allowance)
    job.launcher.spares_crash_once_connected(100)
    job.launcher.step_seconds = 0.1
    async with job:
        await job.finished()
    _assert_finished(job, incidents=0)
    crashed = [f for f in job.launcher.fakes.values() if f.settings.role == "spare" and f.code == 1]
    assert len(crashed) == MAX_FAILED_STARTS + 1, len(crashed)


async def test_spares_that_never_start_stop_being_replaced(
    tmp_path: Path, allowance: Counts
) -> None:
    """The real coordinator against in-process fake ranks over the real protocol: when every spare
    dies at start, the pool stops starting them after a bound; the job trains on to its end all the
    same."""
    job = Job(tmp_path, allowance)
    job.launcher.spares_die_at_start(100)
    job.launcher.step_seconds = 0.1  # long enough for the coordinator to see each spare die
    async with job:
        await job.finished()
    _assert_finished(job, incidents=0)
    spares = [f for f in job.launcher.fakes.values() if f.settings.role == "spare"]
    assert len(spares) == 1 + MAX_FAILED_STARTS


def _forged_gpu_loss(job: Job, victim: Member) -> Migration:
    """An incident started on a claim that `victim`'s GPU fell off the bus, sent as any client of
    Temporal could send it (the job saw nothing of it)."""
    c = job.coordinator
    ev = Evidence(
        kind=FailureKind.GPU_FELL_OFF_BUS,
        source=EventSource.NVML,
        job_id=c.job_id,
        failure_domain=victim.node,
        slots=(victim.slot,),
        xid=79,
        observed_at=datetime.now(UTC),
    )
    report = FailureReport(evidence=ev, job_task_queue="forged", generation=c.generation)
    return Migration(job, incident_workflow_id(c.job_id, victim.node, c.generation), report)


async def test_a_failure_claimed_of_a_healthy_rank_is_refuted_and_nothing_is_fenced(
    tmp_path: Path, allowance: Counts
) -> None:
    """A report from another source naming a rank the job sees training (here forged, as any client
    of Temporal could send it: once, the coordinator SIGKILLed the healthy rank and booked a
    migration): the rank shows progress after it arrived, so the claim is refuted, recorded as not a
    failure, and the world never changes."""
    job = Job(tmp_path, allowance)
    job.launcher.step_seconds = 0.2  # the job still trains while the claim is checked
    async with job:
        c = job.coordinator
        await until(lambda: all(m.step >= 2 for m in c.roster.ranks()), "the ranks to train")
        victim = c.roster.at(1)
        assert victim is not None
        m = _forged_gpu_loss(job, victim)
        outcome = await m.run()
        assert (
            m.confirmed is not None and not m.confirmed.confirmed and m.confirmed.fenced_slots == ()
        )
        assert "refuted by the job: rank(s) [1]" in m.confirmed.detail
        assert outcome.disposition is Disposition.NOT_A_FAILURE and not outcome.success
        assert (
            c.roster.at(1) is victim
            and not victim.fenced
            and job.launcher.poll(victim.agent_id) is None
        )
        await job.finished()
    # kept apart: not among the job's incidents, in its result nor in its incident log
    r = _assert_finished(job, incidents=0, refuted=1)
    assert r.generation == 0 and r.refuted_claims == (outcome,)
    assert not (job.spec.job_dir / "incidents.jsonl").exists()
    assert job.reports.empty()  # the job itself saw no failure


async def test_a_claim_is_checked_for_as_long_as_the_jobs_own_hang_detection_takes(
    tmp_path: Path, allowance: Counts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job whose steps are longer than the refutation's least wait (big models take seconds a
    step) and whose hang timeout says so: a forged claim of a healthy rank is still refuted, because
    the job watches for as long as its own hang detection would before it takes the rank for lost.
    (With the least wait alone, the healthy rank was fenced and migrated on the claim.)"""
    monkeypatch.setattr(confirm, "REFUTE_WAIT", timedelta(seconds=0.3))  # shorter than a step
    job = Job(tmp_path, allowance, hang_timeout=3.0)
    job.launcher.step_seconds = 1.2
    async with job:
        c = job.coordinator
        await until(lambda: all(m.step >= 1 for m in c.roster.ranks()), "the ranks to train")
        # Each rank's last progress (its step's collective) in: the next is a whole step away, none
        # comes within the least wait.
        await until(
            lambda: all(m.collective_step == m.step for m in c.roster.ranks()),
            "every rank to enter its step's collective",
        )
        victim = c.roster.at(1)
        assert victim is not None
        m = _forged_gpu_loss(job, victim)
        outcome = await m.run()
        assert m.confirmed is not None and m.confirmed.fenced_slots == (), m.confirmed
        assert outcome.disposition is Disposition.NOT_A_FAILURE, outcome
        assert c.roster.at(1) is victim and not victim.fenced
        job.launcher.step_seconds = 0.0
        await job.finished()


async def test_a_planned_move_claimed_without_the_jobs_signature_is_refused(
    tmp_path: Path, allowance: Counts
) -> None:
    """A drain of a healthy rank sent through Temporal (here forged, as any client could) cannot be
    refuted by watching the rank, which is healthy by definition: without a signature under the
    job's secret it is refused, recorded as not a failure, and nothing is frozen or fenced. The same
    claim signed is genuine."""
    job = Job(tmp_path, allowance)
    job.launcher.step_seconds = 0.05
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
        assert c.signed(sign(c._secret, ev)) and not c.signed(ev)
        assert not c.signed(sign(b"another job's secret", ev))
        report = FailureReport(evidence=ev, job_task_queue="forged", generation=c.generation)
        m = Migration(job, incident_workflow_id(c.job_id, victim.node, c.generation), report)
        outcome = await m.run()
        assert (
            m.confirmed is not None and not m.confirmed.confirmed and m.confirmed.fenced_slots == ()
        )
        assert "not signed with its secret" in m.confirmed.detail
        assert outcome.disposition is Disposition.NOT_A_FAILURE
        assert (
            c.roster.at(1) is victim
            and not victim.fenced
            and job.launcher.poll(victim.agent_id) is None
        )
        await job.finished()
    r = _assert_finished(job, incidents=0, refuted=1)
    assert r.generation == 0 and r.refuted_claims == (outcome,)


async def test_a_drain_asked_for_during_a_recovery_is_the_next_incident(
    tmp_path: Path, allowance: Counts
) -> None:
    """The real coordinator against in-process fake ranks over the real protocol: an operator drains
    rank 0 while the recovery of rank 2 moves its state. The drain waits (it moves a healthy rank,
    not a loss of this recovery) and, once the world trains again, is the next incident, migrated
    live: on the previous main it was dropped when the recovery ended (its rank was alive, so taken
    as already repaired) and the operator's request left no record."""
    job = Job(tmp_path, allowance, nproc=4, spares=2)
    job.launcher.fail_at(2, 5)
    # the job still trains when the drain's turn comes, on a busy machine
    job.launcher.step_seconds = 0.2
    async with job:
        transfer = job.steps.transfer

        async def drain_then_transfer(
            ref: IncidentRef, tick: Callable[[int], None]
        ) -> TransferResult:
            reply = await asyncio.to_thread(
                request, job.spec.state_dir, job.spec.job_id, wire.Drain(slot=0)
            )
            assert isinstance(reply, wire.Ok), reply
            return await transfer(ref, tick)

        job.steps.transfer = drain_then_transfer  # type: ignore[method-assign]
        first = Migration(job, *await job.report())
        assert (await first.run()).disposition is Disposition.MIGRATED
        job.steps.transfer = transfer  # type: ignore[method-assign]
        workflow_id, report = await job.report()
        assert (report.evidence.kind, report.evidence.slots) == (FailureKind.NODE_DRAIN, (0,))
        assert workflow_id != first.ref.workflow_id
        second = Migration(job, workflow_id, report)
        outcome = await second.run()
        assert (outcome.disposition, outcome.lost_slots, outcome.steps_recomputed) == (
            Disposition.MIGRATED,
            (0,),
            0,
        )
        await job.finished()
    _assert_finished(job, incidents=2)


async def test_a_run_squatting_the_incident_id_with_a_false_claim_is_refused_and_the_incident_moves(
    tmp_path: Path, allowance: Counts
) -> None:
    """Rank 2 dies; the run at its incident's id was started by somebody else (a squatter, on the
    job's own task queue) with a claim that rank 1 died too, which the job never sees. Confirm of
    that run refuses it (recorded as not a failure, nothing fenced), and the incident moves to a
    fresh id where the job's own report is delivered again and migrated live. On the previous main
    the squatter's run was taken as the job's incident, its false claim on the record."""
    job = Job(tmp_path, allowance, nproc=4)
    job.launcher.fail_at(2, 5)
    async with job:
        workflow_id, report = await job.report()
        claim = report.evidence.model_copy(update={"slots": (1,), "detail": "a squatter's claim"})
        squatter = Migration(job, workflow_id, report.model_copy(update={"evidence": claim}))
        # the job's own report, folded into the squatter's run
        squatter.evidence.append(report.evidence)
        refused = await squatter.run()
        assert squatter.confirmed is not None and not squatter.confirmed.confirmed
        assert "rank(s) [1] failed, which the job has not lost" in squatter.confirmed.detail
        assert (
            refused.disposition is Disposition.NOT_A_FAILURE
            and squatter.confirmed.fenced_slots == ()
        )
        moved, again = await job.report()
        assert moved.startswith(workflow_id + ":x") and again.evidence == report.evidence
        m = Migration(job, moved, again)
        outcome = await m.run()
        _assert_migrated_live(job, m, outcome, lost=2, target=4)
        await job.finished()
    r = _assert_finished(job, incidents=1, refuted=1)
    assert r.incidents == (outcome,) and r.refuted_claims == (refused,)


async def test_the_coordinators_store_refuses_torchs_own_client(
    tmp_path: Path, allowance: Counts
) -> None:
    """The coordinator's store, as a rank of another host would reach it: torch's TCPStore client
    (what anyone could use against the previous main's store to read, write and delete the group's
    keys) gets nothing."""
    async with Job(tmp_path, allowance) as job:
        host, _, port = job.coordinator._store_address.rpartition(":")
        with pytest.raises((dist.DistStoreError, RuntimeError)):
            intruder = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=1))
            intruder.set("gen0/0", "an attacker's address")
        await job.finished()


async def test_a_spare_killed_on_request_is_replaced_and_the_next_failure_is_migrated_live(
    tmp_path: Path, allowance: Counts
) -> None:
    """`torchpass inject kill --spare` (chaos): the warm spare is killed at once, nothing is
    migrated or reported, the pool starts another, and a rank killed next is migrated live onto
    it."""
    job = Job(tmp_path, allowance)
    job.launcher.step_seconds = 0.1
    async with job:
        c = job.coordinator
        await until(lambda: len(c.spares.ready()) == 1, "the spare to warm up")
        (first,) = [m.agent_id for m in c.spares.ready()]
        hit = wire.Inject(action=wire.InjectAction.KILL, slot=0, target=wire.InjectTarget.SPARE)
        reply = await asyncio.to_thread(request, job.spec.state_dir, job.spec.job_id, hit)
        assert isinstance(reply, wire.Ok) and reply.detail == {
            "action": "kill",
            "target": "spare",
            "agent": first,
            "was": "warm",
        }
        await until(
            lambda: [m.agent_id for m in c.spares.ready()] not in ([], [first]), "another spare"
        )
        at = max(m.step for m in c.roster.ranks()) + 2
        kill = wire.Inject(action=wire.InjectAction.KILL, slot=1, after_step=at)
        assert isinstance(
            await asyncio.to_thread(request, job.spec.state_dir, job.spec.job_id, kill), wire.Ok
        )
        m = Migration(job, *(await job.report()))
        outcome = await m.run()
        assert outcome.success and outcome.lost_slots == (1,)
        assert m.reserved is not None and first not in m.reserved.spare_ids
        await job.finished()
    _assert_finished(job, incidents=1)


def test_a_spare_is_hit_at_once_or_not_at_all() -> None:
    with pytest.raises(ValueError, match="at once"):
        wire.Inject(
            action=wire.InjectAction.KILL, slot=0, after_step=3, target=wire.InjectTarget.SPARE
        )
    with pytest.raises(ValueError, match="at once"):
        wire.Inject(action="kill", slot=0, during="transfer", target=wire.InjectTarget.SPARE)
