"""Fixtures of the unit tier."""

from __future__ import annotations

import pytest

from tests.unit.job_driver import Counts, Job, quiet


@pytest.fixture(scope="session")
async def allowance(tmp_path_factory: pytest.TempPathFactory) -> Counts:
    """What a coordinator that ran and shut down still holds while referenced (its TCPStore's own),
    measured after a first run made the process's one-time set-ups (the loop's executor, torch's).
    The larger of two runs: a descriptor an earlier test left for the collector, closed during one,
    would understate it."""
    async with Job(tmp_path_factory.mktemp("warm-up"), None) as job:
        await job.finished()
    del job
    runs = []
    for k in range(2):
        before = await quiet()
        async with Job(tmp_path_factory.mktemp(f"baseline{k}"), None) as job:
            await job.finished()
        runs.append(tuple(max(0, a - b) for a, b in zip(await quiet(), before, strict=True)))
        del job
    return tuple(max(r) for r in zip(*runs, strict=True))
