"""docs/architecture.md is the map of the tree, and the docs name only modules that exist: the
page's generated parts (the layers from the import contracts, every module with its docstring's
first sentence) must match the tree, and a module path or dotted name in any doc that names no
module fails. Regenerate with `python -m tests.architecture_map`."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests import architecture_map

ROOT = architecture_map.ROOT
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md", ROOT / "deploy" / "README.md"]
TOPS = (*architecture_map.PACKAGES, "tests", "bench", "examples")
PATH = re.compile(r"\b((?:{})/[\w/]*\w\.py)\b".format("|".join(TOPS)))
DOTTED = re.compile(r"`((?:{})(?:\.\w+)+)(?![\w/])".format("|".join(architecture_map.PACKAGES)))


def test_the_generated_parts_of_the_architecture_page_match_the_tree() -> None:
    page = architecture_map.DOC.read_text()
    assert architecture_map.render(page) == page, "run `python -m tests.architecture_map`"


def test_the_architecture_page_names_every_module() -> None:
    page = architecture_map.DOC.read_text()
    modules = [p for top in architecture_map.PACKAGES for p in (ROOT / top).rglob("*.py")]
    unnamed = [str(p.relative_to(ROOT)) for p in modules if f"`{p.relative_to(ROOT)}`" not in page]
    unnamed = [u for u in unnamed if not u.endswith("__init__.py") or "`" + u + "`" in page]
    assert not unnamed, unnamed


def _defined(module: Path) -> set[str]:
    """The names a module defines (not the ones it imports), and what a package's face exports."""
    tree = ast.parse(module.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif module.name == "__init__.py" and isinstance(node, ast.Constant):
            names.add(str(node.value))  # its `__all__`
    return names


def _names_a_module(dotted: str) -> bool:
    """`a.b.c` names a module or package, or something defined in one (`module.Class.method`)."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:n])
        module = (
            base.with_suffix(".py") if base.with_suffix(".py").exists() else base / "__init__.py"
        )
        if module.exists():
            rest = parts[n:]
            return not rest or (len(rest) <= 2 and rest[0] in _defined(module))
    return False


def test_every_module_a_doc_names_exists() -> None:
    stale = {}
    for doc in DOCS:
        text = doc.read_text()
        for path in PATH.findall(text):
            if not (ROOT / path).exists():
                stale[f"{doc.name}: {path}"] = "no such file"
        for dotted in DOTTED.findall(text):
            if not _names_a_module(dotted):
                stale[f"{doc.name}: {dotted}"] = "no such module"
    assert not stale, stale


def test_every_test_a_doc_names_exists() -> None:
    """`tests/x.py::test_name` in a doc (the events table, the security table) names a real test."""
    stale = []
    for doc in DOCS:
        for path, name in re.findall(r"(tests/[\w/]+\.py)::(\w+)", doc.read_text()):
            f = ROOT / path
            tree = ast.parse(f.read_text()) if f.exists() else ast.Module(body=[], type_ignores=[])
            defined = {
                n.name
                for n in ast.walk(tree)
                if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
            }
            if name not in defined:
                stale.append(f"{doc.name}: {path}::{name}")
    assert not stale, stale


def test_the_staleness_check_finds_a_moved_module() -> None:
    """It can fail: a path and a dotted name of modules that moved are both caught."""
    assert not _names_a_module("job_agent.steps")
    assert not (ROOT / "job_agent/incident.py").exists()
    assert _names_a_module("job_agent.coordinator.incident.executor.IncidentSteps")
    # imported there
    assert not _names_a_module("job_agent.coordinator.incident.executor.JobControl")
    assert PATH.findall("see `job_agent/coordinator/coordinator.py`") == [
        "job_agent/coordinator/coordinator.py"
    ]
