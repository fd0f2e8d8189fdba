"""The proof catches what it claims to: real ranks, real kills, a real fault in one of them.

`faulty_train_dp.py` is the example script with a fault armed once: a receiver whose installed state
differs from what it was sent (a wrong value after `load_state_dict`), or a rank that skips a step
after the world re-forms. Each time the job must refuse to call the migration live, fall back to a
checkpoint restart, and still end bitwise equal to an uninterrupted run; the steps recomputed the
outcome records are the ones the coordinator counted independently.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.client import Client

from tests.integration.conftest import ROOT, run_with, spec
from torchpass.job import JobResult
from torchpass.models import Disposition

pytestmark = pytest.mark.integration
FAULTY = ROOT / "tests" / "integration" / "faulty_train_dp.py"


def _armed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variable: str) -> Path:
    flag = tmp_path / f"{variable.lower()}.armed"
    flag.touch()
    monkeypatch.setenv(variable, str(flag))
    return flag


def assert_restarted_not_live(result: JobResult, reference: JobResult, why: str) -> None:
    assert result.ok, result.error
    (o,) = result.incidents
    assert o.disposition == Disposition.FALLBACK_RESTART and not o.success
    assert o.error and "proof does not hold" in o.error and why in o.error, o.error
    # a qualifying failure we did not migrate live: counts against us
    assert o.classification.qualifying
    assert o.steps_recomputed > 0 and o.steps_recomputed == result.steps_recomputed
    assert result.final_digest == reference.final_digest


async def test_a_wrong_value_in_a_receivers_state_fails_the_proof(
    client: Client, reference: JobResult, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    flag = _armed(tmp_path, monkeypatch, "FAULT_CORRUPT_ONCE")
    result = await run_with(
        client, spec(tmp_path, "corrupt-receive", script=FAULTY), [("kill", 2, 25)]
    )
    assert not flag.exists()  # the spare did install, and the fault fired
    assert_restarted_not_live(result, reference, "rank 2 holds state hashing to")


async def test_a_rank_resuming_at_another_step_fails_the_proof(
    client: Client, reference: JobResult, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    flag = _armed(tmp_path, monkeypatch, "FAULT_SKIP_ONCE")
    monkeypatch.setenv("FAULT_SKIP_SLOT", "1")
    result = await run_with(client, spec(tmp_path, "skip-a-step", script=FAULTY), [("kill", 2, 25)])
    assert not flag.exists()
    assert_restarted_not_live(result, reference, "rank 1 resumed at step")
