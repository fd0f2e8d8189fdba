"""Saved MigrationWorkflow and ContractWorkflow histories replay against today's code: a
non-deterministic change fails here.

Regenerate them (after an intended change, once no old run can still be in flight) with
`TORCHPASS_SAVE_HISTORIES=1 .venv/bin/python -m pytest tests/workflows/test_migration.py
tests/workflows/test_migration_proof.py` (or `test_contract.py`, whose histories are
`contract_<test>_run<k>.json`, one per run of a contract). `v1_*.json` are MigrationWorkflow
histories recorded before the `measured-outcome` patch, `v2_*.json` before the `activity-names`
patch (the job activities `reserve_spare` and `recorded_outcome`), `v3_*.json` before the
`job-attestation` patch (an outcome recorded on a contract without the job's signature),
`v1_contract_*.json`
ContractWorkflow histories recorded before the `verified-ledger` patch: they must keep replaying
through the legacy paths.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from tests.workflows import (
    test_contract,
    test_contract_bounds,
    test_ledger_checks,
    test_migration,
    test_migration_proof,
)
from workflows.contract import CONTRACT_WORKFLOWS
from workflows.migration import MigrationWorkflow

HISTORIES = sorted((Path(__file__).resolve().parents[1] / "histories").glob("*.json"))


def test_there_are_histories_to_replay() -> None:
    # An empty folder would turn the replay test below into a silent skip: fail loudly instead.
    assert HISTORIES, "tests/histories/ has no saved histories"


def test_every_workflow_test_has_a_saved_history() -> None:
    tests = {
        n for m in (test_migration, test_migration_proof) for n in dir(m) if n.startswith("test_")
    }
    assert tests <= {p.stem for p in HISTORIES}, (
        "regenerate the histories (see this module's docstring)"
    )


def test_every_contract_test_has_saved_histories() -> None:
    modules = (test_contract, test_contract_bounds)
    tests = {f"contract_{n}_run0" for m in modules for n in dir(m) if n.startswith("test_")}
    tests.add("contract_test_the_30000_usd_forgery_earns_no_credit_run0")
    tests |= {n for n in dir(test_ledger_checks) if n.startswith("test_a")}  # their incidents'
    assert tests <= {p.stem for p in HISTORIES}, (
        "regenerate the histories (see this module's docstring)"
    )


@pytest.mark.parametrize("path", HISTORIES, ids=[p.stem for p in HISTORIES])
async def test_saved_history_replays(path: Path) -> None:
    history = WorkflowHistory.from_json(path.stem, path.read_text())
    # The replayer picks each history's workflow by its type name.
    replayer = Replayer(
        workflows=[MigrationWorkflow, *CONTRACT_WORKFLOWS], data_converter=pydantic_data_converter
    )
    result = await replayer.replay_workflow(history, raise_on_replay_failure=True)
    assert result.replay_failure is None
