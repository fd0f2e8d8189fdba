"""The house rules that no linter checks: small modules in the packages."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("torchpass", "job_agent", "activities", "workflows", "workers")
MAX_LINES = 400


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_is_over_400_lines(package: str) -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for p in sorted((ROOT / package).rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"split these modules (docs/architecture.md): {long}"


def test_no_line_is_over_100_characters() -> None:
    """ruff's E501 passes a line it cannot break (a long URL, a `noqa`); the rule here does not."""
    tops = (*PACKAGES, "tests", "bench", "examples")
    long = [
        f"{p.relative_to(ROOT)}:{i}"
        for top in tops
        for p in sorted((ROOT / top).rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if len(line) > 100
    ]
    assert not long, f"lines over 100 characters: {long}"


def test_the_coordinator_class_is_under_300_lines() -> None:
    """Its roles live in their own modules (detection, injection, spares, transfer, incident,
    steps)."""
    tree = ast.parse((ROOT / "job_agent" / "coordinator" / "coordinator.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Coordinator"]
    assert cls.end_lineno is not None and cls.end_lineno - cls.lineno + 1 < 300


def test_the_coordinator_node_agent_and_their_commands_load_no_torch() -> None:
    """What import-linter cannot see: a package's `__init__` runs on every import below it, so the
    job agent's public face (`from job_agent import RankAgent`) must not load torch for the
    coordinator's sake. Run in a fresh interpreter, where nothing imported torch before."""
    code = (
        "import sys\n"
        "import torchpass.cli, torchpass.cli.run, torchpass.cli.job, torchpass.cli.node\n"
        "import workers.job, workers.local_nodes\n"
        "import activities.job, job_agent.coordinator.coordinator, job_agent.node.agent\n"
        "print(sorted(m for m in ('torch', 'numpy', 'blake3') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
