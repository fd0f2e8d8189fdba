"""What a job without the agent (an unmodified torchrun script) is refused, before anything
starts."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from torchpass.job import JobSpec


def _spec(tmp_path: Path, **fields: object) -> JobSpec:
    (tmp_path / "train.py").write_text("")
    return JobSpec(job_id="j", script=tmp_path / "train.py", nproc=4, state_dir=tmp_path, **fields)


def test_a_job_without_the_agent_runs_on_one_host_with_no_spares(tmp_path: Path) -> None:
    assert not _spec(tmp_path, agent=False, spares=0).agent
    with pytest.raises(ValidationError, match="spares are of no use"):
        _spec(tmp_path, agent=False, spares=1)
    with pytest.raises(ValidationError, match="runs its ranks on one host"):
        _spec(tmp_path, agent=False, spares=0, nodes=2)
    assert _spec(tmp_path, spares=0, nodes=2).nodes == 2  # with the agent, across nodes
