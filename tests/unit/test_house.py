"""The house rules that no linter checks: small modules in the packages."""

from __future__ import annotations

import ast
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


def test_the_coordinator_class_is_under_300_lines() -> None:
    """Its roles live in their own modules (detection, injection, spares, transfer, incident, steps)."""
    tree = ast.parse((ROOT / "job_agent" / "coordinator" / "coordinator.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Coordinator"]
    assert cls.end_lineno is not None and cls.end_lineno - cls.lineno + 1 < 300
