"""A CUDA driver fault (the brief's "CUDA driver fault", an interruption): the rank's step ends in
the error torch raises for it, the agent reports a device error and ends the process at once (its
GPU is not to be trusted), and the job migrates the rank live. No GPU exists here:
`faulty_train_dp.py` raises the exception torch would, on one rank at one step; the report, the
exit, the incident and the recovery are real, and the run ends bitwise equal to one never failed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.client import Client

from tests.integration.conftest import run_with, spec
from tests.integration.test_proof import FAULTY, _armed
from torchpass.job import JobResult
from torchpass.models import Category, Disposition, FailureKind

pytestmark = pytest.mark.integration


async def test_a_cuda_driver_fault_is_an_interruption_migrated_live(
    client: Client, reference: JobResult, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    flag = _armed(tmp_path, monkeypatch, "FAULT_CUDA_ONCE")
    monkeypatch.setenv("FAULT_CUDA_SLOT", "1")
    monkeypatch.setenv("FAULT_CUDA_STEP", "25")
    result = await run_with(client, spec(tmp_path, "cuda-fault", script=FAULTY))
    assert not flag.exists()  # the fault fired
    assert result.ok, result.error
    (o,) = result.incidents
    assert o.kind is FailureKind.CUDA_ERROR and o.lost_slots == (1,), o
    assert o.classification.category is Category.INTERRUPTION and o.classification.qualifying
    assert o.disposition is Disposition.MIGRATED and o.success, o
    assert result.steps_recomputed == 0
    assert result.final_digest == reference.final_digest
