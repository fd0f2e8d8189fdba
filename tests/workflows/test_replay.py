"""Saved MigrationWorkflow histories replay against today's code: a non-deterministic change fails here.

Regenerate them (after an intended, patched change) with
`TORCHPASS_SAVE_HISTORIES=1 .venv/bin/python -m pytest tests/workflows/test_migration.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from workflows.migration import MigrationWorkflow

HISTORIES = sorted((Path(__file__).resolve().parents[1] / "histories").glob("*.json"))


def test_there_are_histories_to_replay() -> None:
    assert len(HISTORIES) >= 5, "tests/histories/ lost its saved histories"


@pytest.mark.parametrize("path", HISTORIES, ids=[p.stem for p in HISTORIES])
async def test_saved_history_replays(path: Path) -> None:
    history = WorkflowHistory.from_json(path.stem, path.read_text())
    replayer = Replayer(workflows=[MigrationWorkflow], data_converter=pydantic_data_converter)
    await replayer.replay_workflow(history)
