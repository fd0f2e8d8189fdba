"""A job-side step heartbeats each second while it runs, so that a job worker or a Temporal server lost
mid-step is noticed within the step's short heartbeat timeout (a restart once cost 21-22 s of waiting out
timeouts). temporalio's ActivityEnvironment: the real activity context, no server."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio.testing import ActivityEnvironment

from activities.job import BEAT_EVERY, _BytesSent, _guard
from torchpass.ids import JobActivity
from torchpass.policies import ACTIVITY_TIMEOUTS


async def test_a_slow_step_heartbeats_each_second_with_its_details_and_stops_when_done() -> None:
    env, beats = ActivityEnvironment(), []
    env.on_heartbeat = lambda *details: beats.append(details)
    sent = _BytesSent()

    async def slow_transfer() -> int:
        sent(10)
        await asyncio.sleep(1.5)
        sent(2048)
        await asyncio.sleep(1.5)
        return 7

    assert await env.run(_guard, slow_transfer(), sent.details) == 7
    assert len(beats) >= 3 and beats[-1] == ({"bytes_sent": 2048},), beats
    n = len(beats)
    await asyncio.sleep(2 * BEAT_EVERY)
    assert len(beats) == n  # the step is over: no more beats


def test_every_job_step_has_a_heartbeat_timeout_well_above_its_beat() -> None:
    steps = [getattr(JobActivity, n) for n in dir(JobActivity) if n.isupper()]
    for name in steps:
        if name == JobActivity.DESCRIBE_JOB:  # validation's own short bound
            continue
        hb = ACTIVITY_TIMEOUTS[name].heartbeat
        assert hb is not None and timedelta(seconds=3 * BEAT_EVERY) <= hb <= timedelta(seconds=5), name
