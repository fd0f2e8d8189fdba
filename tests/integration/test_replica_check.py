"""Silent divergence and data corruption caught while the job trains: real ranks, one of whose
memory goes bad after a step (`faulty_train_dp.py`, one parameter's sign flipped). At the steps the
job checks, every rank reports the digest of what it holds and the coordinator compares them; the
odd one out is an incident of its own kind (silent data corruption: the brief's "Unable to recover"
row, never counted), fenced and rebuilt from the majority of its replicas, live."""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.client import Client

from tests.integration.conftest import ROOT, run_with, spec
from tests.integration.test_proof import _armed
from torchpass.job import JobState
from torchpass.models import Disposition, FailureKind

pytestmark = pytest.mark.integration
FAULTY = ROOT / "tests" / "integration" / "faulty_train_dp.py"


@pytest.fixture
def flipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    flag = _armed(tmp_path, monkeypatch, "FAULT_FLIP_ONCE")
    monkeypatch.setenv("FAULT_FLIP_SLOT", "2")
    monkeypatch.setenv("FAULT_FLIP_STEP", "12")
    return flag


async def test_a_corrupted_replica_is_named_and_rebuilt_from_the_majority_live(
    client: Client, tmp_path: Path, flipped: Path
) -> None:
    result = await run_with(client, spec(tmp_path, "flip-checked", script=FAULTY, verify_every=10))
    assert not flipped.exists()  # the fault fired
    assert result.ok, result.error  # every replica ends in one state again
    (o,) = result.incidents
    assert o.kind is FailureKind.SILENT_DATA_CORRUPTION and o.lost_slots == (2,), o
    assert (
        "rank(s) 2 held another state" in o.classification.reason
        and "after step 19" in o.classification.reason
    )
    assert not o.classification.qualifying  # the brief's row: recorded, never counted
    assert (
        o.disposition is Disposition.MIGRATED and o.steps_recomputed == 0 == result.steps_recomputed
    ), o
    assert o.proof is not None and o.proof.donor_slot != 2


async def test_a_replica_differing_after_the_redone_step_is_caught_there_with_periodic_checks_off(
    client: Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 is killed; rank 2's state goes bad as it completes the recovery's redone step. With
    the periodic check off, the check right after a recovery's redone step still catches it at once,
    names rank 2 and rebuilds it live; the job ends with its replicas one state."""
    flag = _armed(tmp_path, monkeypatch, "FAULT_FLIP_ONCE")
    monkeypatch.setenv("FAULT_FLIP_SLOT", "2")
    monkeypatch.setenv("FAULT_FLIP_STEP", "redone")
    job = spec(tmp_path, "flip-after-redo", script=FAULTY, verify_every=0, spares=2)
    result = await run_with(client, job, [("kill", 0, 12)])
    assert not flag.exists()  # the fault fired
    assert result.ok, result.error
    lost, odd = result.incidents
    assert lost.lost_slots == (0,) and lost.disposition is Disposition.MIGRATED, lost
    assert lost.step_before is not None
    redone = lost.step_before + 1
    assert odd.kind is FailureKind.SILENT_DATA_CORRUPTION and odd.lost_slots == (2,), odd
    assert f"after step {redone}" in odd.classification.reason, (redone, odd.classification.reason)
    assert odd.disposition is Disposition.MIGRATED and result.steps_recomputed == 0


async def test_without_the_check_the_corruption_is_only_found_at_the_end(
    client: Client, tmp_path: Path, flipped: Path
) -> None:
    """The same fault with the periodic check off: nothing is caught while training, and the job's
    end refuses to call it finished (the replicas' final digests differ), naming the rank."""
    result = await run_with(client, spec(tmp_path, "flip-unchecked", script=FAULTY, verify_every=0))
    assert not flipped.exists() and not result.incidents
    assert (
        result.status is JobState.FAILED and result.error and "rank(s) 2 differ" in result.error
    ), result
