"""The coordinator's hang, heartbeat, node-silence and freeze logic in simulated time
(`coordinator.clock`): the real watch, detector, freeze step and bounded waits, given a
`SimulatedClock` that moves only when the test moves it. A 10 s hang timeout or a 30 s freeze
timeout is checked to the tenth of a second, whatever the machine's load, and the test takes
milliseconds."""

from __future__ import annotations

import asyncio
import socket
from datetime import timedelta
from types import SimpleNamespace
from typing import Any, cast

import pytest

from job_agent import wire
from job_agent.coordinator.clock import SimulatedClock
from job_agent.coordinator.detect.detection import Detector
from job_agent.coordinator.detect.watch import WATCH_EVERY, watch
from job_agent.coordinator.incident.executor import IncidentSteps
from job_agent.coordinator.incident.job_control import JobControl
from job_agent.coordinator.incident.lifecycle import Incident, IncidentState
from job_agent.coordinator.members import Member, Roster
from job_agent.coordinator.node_launcher import NodeLauncher
from job_agent.coordinator.waiting import Changes
from job_agent.wire.operator import MemberState
from job_agent.wire.rank import Role
from torchpass.incident.steps import IncidentRef
from torchpass.job import JobState
from torchpass.models import Evidence, FailureKind

HANG = timedelta(seconds=10)
TICK = WATCH_EVERY.total_seconds()


def _ranks(roster: Roster, clock: SimulatedClock, n: int, step: int) -> list[Member]:
    """`n` ranks training at `step`, each in its collective of the step before."""
    out = []
    for slot in range(n):
        m = Member(f"rank{slot}-{slot + 1}", Role.RANK, slot, 100 + slot, f"node{slot}")
        m.last_heartbeat = m.last_progress = clock.monotonic()
        roster.members[m.agent_id] = m
        for frame in (wire.Collective(k=step - 1), wire.Step(k=step)):
            m.observe(frame, clock.monotonic(), clock.wall())
        out.append(m)
    return out


class _Watched:
    """What the watch reads and does of a job, the rest of the coordinator left out."""

    def __init__(self, clock: SimulatedClock, roster: Roster) -> None:
        self.spec = SimpleNamespace(node_timeout=30.0)
        self.clock, self.roster, self.state, self.world_size = clock, roster, JobState.TRAINING, 3
        self.nodes = None
        self.killed: list[str] = []
        self.incidents = SimpleNamespace(current=None)
        self.detector = Detector("job", roster, HANG, clock)
        self.launcher = SimpleNamespace(poll=lambda a: None, kill=self.killed.append)
        self.spares = SimpleNamespace(held=lambda wf: [])
        self.evidence: list[tuple[float, Evidence]] = []

    def fail(self, error: str | None, state: JobState = JobState.FAILED) -> None:
        raise AssertionError(f"the job failed: {error}")

    def add_evidence(self, ev: Evidence) -> None:
        self.evidence.append((self.clock.monotonic(), ev))


async def _run_watch(
    job: _Watched, clock: SimulatedClock, seconds: float, beat: list[Member]
) -> None:
    """The watch over `seconds` of simulated time, the ranks in `beat` heart-beating every tick."""
    task = asyncio.ensure_future(watch(cast(Any, job)))
    try:
        for _ in range(round(seconds / TICK)):
            for m in beat:
                m.observe(wire.Heartbeat(), clock.monotonic(), clock.wall())
            await clock.advance(TICK)
    finally:
        task.cancel()


async def test_a_silent_rank_is_hung_just_past_the_hang_timeout_timed_from_its_last_heartbeat() -> (
    None
):
    clock, roster = SimulatedClock(), Roster()
    r0, r1, r2 = _ranks(roster, clock, 3, step=5)
    job, silent_since = _Watched(clock, roster), clock.monotonic()
    await _run_watch(job, clock, HANG.total_seconds() - 0.2, beat=[r0, r1])
    assert job.evidence == []  # 9.8 s of silence is not a hang
    await _run_watch(job, clock, 0.5, beat=[r0, r1])
    ((at, ev),) = job.evidence
    assert (ev.kind, ev.slots) == (FailureKind.HANG, (2,)) and "no heartbeat for 10." in ev.detail
    assert (
        silent_since + HANG.total_seconds() < at <= silent_since + HANG.total_seconds() + 2 * TICK
    )
    # its last sign of life, not detection
    assert ev.last_progress_at == clock.as_wall(silent_since)
    assert r2.fenced  # reported once: confirm kills it


async def test_a_rank_absent_from_its_peers_collective_is_hung_and_a_busy_one_is_not() -> None:
    """It still heart-beats (its own code or a kernel is stuck) but never enters the collective of
    step 6 its peers have waited in for the hang timeout. A rank that said it is busy (a rank-0-only
    evaluation) is late, not hung."""
    clock = SimulatedClock()
    for busy in (False, True):
        roster = Roster()
        r0, r1, r2 = _ranks(roster, clock, 3, step=6)
        job = _Watched(clock, roster)
        if busy:
            r2.observe(wire.Busy(what="eval", busy=True), clock.monotonic(), clock.wall())
        waiting_since = clock.monotonic()
        for m in (r0, r1):
            m.observe(wire.Collective(k=6), clock.monotonic(), clock.wall())
        await _run_watch(job, clock, 3 * HANG.total_seconds(), beat=[r0, r1, r2])
        if busy:
            assert job.evidence == []
            continue
        ((at, ev),) = job.evidence
        assert ev.slots == (2,) and "never came" in ev.detail
        assert (
            waiting_since + HANG.total_seconds()
            < at
            <= waiting_since + HANG.total_seconds() + 2 * TICK
        )


async def test_a_process_stopped_in_a_recovery_is_killed_at_the_hang_timeout() -> None:
    """While a recovery runs, a rank or a held spare that sends nothing at all (SIGSTOP, a wedged
    host) is one more loss of it, killed once silent for the hang timeout."""
    clock, roster = SimulatedClock(), Roster()
    r0, r1, r2 = _ranks(roster, clock, 3, step=5)
    job = _Watched(clock, roster)
    inc = Incident("wf")
    inc.move(IncidentState.FREEZING)
    job.incidents.current = inc
    await _run_watch(job, clock, HANG.total_seconds() - 0.2, beat=[r0, r1])
    assert job.killed == []
    await _run_watch(job, clock, 0.5, beat=[r0, r1])
    assert job.killed == [r2.agent_id] and [ev.slots for _, ev in job.evidence] == [(2,)]


class _Job:
    """What the freeze step reads and does of a job."""

    def __init__(self, clock: SimulatedClock, roster: Roster, inc: Incident) -> None:
        self.job_id, self.generation, self.roster = "job", 1, roster
        self.changes = Changes(clock)
        self.incidents = SimpleNamespace(current=inc)
        self.progress = SimpleNamespace(high_water=5)
        self.evidence: list[Evidence] = []

    def fence(self, m: Member) -> None:
        m.fenced, m.state = True, MemberState.LOST

    def abandon(self, generation: int) -> None:
        raise AssertionError("nothing was forming")

    def add_evidence(self, ev: Evidence) -> None:
        self.evidence.append(ev)


async def test_a_rank_that_never_freezes_is_lost_at_the_freeze_timeout() -> None:
    clock, roster = SimulatedClock(), Roster()
    ranks = _ranks(roster, clock, 4, step=6)
    ranks[3].state = MemberState.LOST  # the failure: rank 3 died
    inc = Incident("wf", lost={3})
    job = _Job(clock, roster, inc)
    steps = IncidentSteps(cast(JobControl, job), freeze_timeout=timedelta(seconds=30))
    frozen = asyncio.ensure_future(
        steps.freeze(IncidentRef(workflow_id="wf", run_id="r", job_id="job"))
    )
    await clock.advance(0.5)
    for m in ranks[:2]:  # ranks 0 and 1 leave the failed collective; rank 2 is stuck and never does
        m.observe(wire.Frozen(completed=5), clock.monotonic(), clock.wall())
    job.changes.notify()
    await clock.advance(29.4)
    # 29.9 s: still waiting for rank 2
    assert not frozen.done() and inc.state is IncidentState.FREEZING
    await clock.advance(0.2)
    result = await frozen
    assert (result.completed_steps, result.target_step) == ({0: 5, 1: 5}, 5)
    assert inc.state is IncidentState.FROZEN and inc.lost == {2, 3} and ranks[2].fenced
    (ev,) = job.evidence
    assert (ev.kind, ev.slots) == (FailureKind.HANG, (2,)) and "did not freeze" in ev.detail


async def test_a_bounded_wait_ends_at_its_timeout_to_the_instant_and_ticks_each_second() -> None:
    clock = SimulatedClock()
    changes, ticks, start = Changes(clock), [], clock.monotonic()
    wait = asyncio.ensure_future(
        changes.wait_for(
            lambda: False, timedelta(seconds=5), "nothing", lambda: ticks.append(clock.monotonic())
        )
    )
    await clock.advance(4.99)
    assert not wait.done() and len(ticks) == 4
    await clock.advance(0.02)
    with pytest.raises(TimeoutError, match=r"timed out after 5\.0 s waiting for nothing"):
        await wait
    assert clock.monotonic() - start == pytest.approx(5.01)
    held = [False]
    wait = asyncio.ensure_future(
        changes.wait_for(lambda: held[0], timedelta(seconds=5), "a change")
    )
    await clock.advance(2)
    held[0] = True
    changes.notify()  # a change wakes it at once, not at its next second
    await clock.advance(0)
    assert wait.done() and wait.exception() is None


def test_a_node_unheard_past_the_node_timeout_is_silent_and_a_heartbeat_keeps_it() -> None:
    """The coordinator's view of its node agents (`NodeLauncher`) on the clock it is given: a node
    is silent once unheard for the node timeout, to the tenth of a second, and any frame it sends (a
    heartbeat, twice a second from a live agent) keeps it."""
    clock, timeout = SimulatedClock(), timedelta(seconds=10)
    nodes = NodeLauncher("job-1", 1, lambda agent: False, clock=clock)
    near, far = socket.socketpair()
    try:
        hello = wire.NodeHello(
            job_id="job-1", node="a", host="198.18.0.1", slots=2, spares=0, pid=1
        )
        assert nodes.join(near, hello) is None
        clock.skip(9.9)
        assert nodes.silent(timeout) == []
        assert nodes.heard(near, wire.Heartbeat())
        clock.skip(9.9)
        assert nodes.silent(timeout) == []  # timed from its last word, not from its join
        clock.skip(0.2)
        assert [n.name for n in nodes.silent(timeout)] == ["a"]
    finally:
        near.close()
        far.close()
