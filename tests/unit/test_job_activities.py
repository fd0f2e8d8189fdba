"""A job-side step heartbeats each second while it runs, so that a job worker or a Temporal server
lost mid-step is noticed within the step's short heartbeat timeout (a restart once cost 21-22 s of
waiting out timeouts). temporalio's ActivityEnvironment: the real activity context, no server."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import activity
from temporalio.testing import ActivityEnvironment

from activities.job import BEAT_EVERY, JobActivities, _beat, _BytesSent, _guard
from tests.unit.job_driver import until
from torchpass.ids import JobActivity, JobActivityV0
from torchpass.policies import ACTIVITY_TIMEOUTS
from workers.job import _activity_methods


async def test_a_slow_step_heartbeats_each_second_with_its_details_and_stops_when_done() -> None:
    env, beats = ActivityEnvironment(), []
    env.on_heartbeat = lambda *details: beats.append(details)
    sent = _BytesSent()

    async def slow_transfer() -> int:
        # A step that takes three beats' time, its progress moving half-way: the scenario, not a
        # wait.
        sent(10)
        await asyncio.sleep(1.5 * BEAT_EVERY)
        sent(2048)
        await asyncio.sleep(1.5 * BEAT_EVERY)
        return 7

    def beating() -> list[asyncio.Task[object]]:
        name = _beat.__qualname__
        return [t for t in asyncio.all_tasks() if getattr(t.get_coro(), "__qualname__", "") == name]

    assert await env.run(_guard, slow_transfer(), sent.details) == 7
    assert len(beats) >= 3 and beats[-1] == ({"bytes_sent": 2048},), beats
    n = len(beats)
    await until(lambda: not beating(), "the step's heartbeat task to end")
    assert len(beats) == n  # the step is over: no more beats, and none can come


def test_every_job_step_has_a_heartbeat_timeout_well_above_its_beat() -> None:
    steps = [getattr(JobActivity, n) for n in dir(JobActivity) if n.isupper()]
    for name in steps:
        if name == JobActivity.DESCRIBE_JOB:  # validation's own short bound
            continue
        hb = ACTIVITY_TIMEOUTS[name].heartbeat
        assert hb is not None and timedelta(seconds=3 * BEAT_EVERY) <= hb <= timedelta(seconds=5), (
            name
        )


def test_the_job_worker_serves_every_job_activity_under_todays_names_and_the_old_ones() -> None:
    """A run started before the `activity-names` patch (and every recorded history) still calls
    `reserve_spare` and `recorded_outcome`: the job worker answers both names, each with the same
    step and the same timeouts."""
    served = {
        activity._Definition.must_from_callable(fn).name
        for fn in _activity_methods(JobActivities.__new__(JobActivities))
    }
    today = {getattr(JobActivity, n) for n in dir(JobActivity) if n.isupper()}
    old = {getattr(JobActivityV0, n) for n in dir(JobActivityV0) if n.isupper()}
    assert served == today | old
    assert (
        ACTIVITY_TIMEOUTS[JobActivityV0.RESERVE_SPARE]
        == ACTIVITY_TIMEOUTS[JobActivity.RESERVE_SPARES]
    )
    fetch = ACTIVITY_TIMEOUTS[JobActivity.FETCH_LOCAL_RECORD]
    assert ACTIVITY_TIMEOUTS[JobActivityV0.RECORDED_OUTCOME] == fetch
