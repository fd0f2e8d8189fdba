"""Every Temporal name torchpass uses is typed once, in `torchpass.ids`: a workflow type, a signal,
a query, an update or an activity named by a string literal anywhere else fails here. A name typed
twice can drift (a renamed signal the sender still sends by its old name is dropped without a
word)."""

from __future__ import annotations

import ast
from pathlib import Path

from torchpass import ids

ROOT = Path(__file__).resolve().parents[2]
SOURCES = (
    "torchpass",
    "job_agent",
    "activities",
    "workflows",
    "workers",
    "tests",
    "bench",
    "examples",
)
NAMES_MODULE = ROOT / "torchpass" / "ids.py"

# Calls whose first argument is a Temporal name, and keyword arguments that are one.
NAMED_BY_FIRST_ARG = {
    "signal",
    "query",
    "execute_update",
    "start_update",
    "start_workflow",
    "execute_workflow",
    "execute_activity",
    "start_activity",
    "execute_local_activity",
    "start_local_activity",
    "get_external_workflow_handle_for",
}
NAMING_KEYWORDS = {"name", "start_signal", "workflow", "activity"}
NAMED_BY_COMPARISON = {"signal_name", "workflow_type", "activity_type", "update_name", "query_type"}


def _torchpass_names() -> set[str]:
    """Every name `torchpass.ids` gives: the string constants of its name classes."""
    classes = (
        ids.WorkflowName,
        ids.IncidentMessage,
        ids.ContractMessage,
        ids.JobActivity,
        ids.JobActivityV0,
        ids.ControlActivity,
        ids.ValidationActivity,
    )
    return {v for c in classes for k, v in vars(c).items() if k.isupper() and isinstance(v, str)}


def _literal(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _typed_names(tree: ast.AST, names: set[str]) -> list[tuple[int, str]]:
    """(line, name) of each torchpass Temporal name given as a literal where a name is expected, and
    of each workflow type name given as a literal anywhere."""
    workflows = set(vars(ids.WorkflowName).values())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if (
                called in NAMED_BY_FIRST_ARG
                and node.args
                and (name := _literal(node.args[0])) in names
            ):
                found.append((node.lineno, name))
            for kw in node.keywords:
                if kw.arg in NAMING_KEYWORDS and (name := _literal(kw.value)) in names:
                    found.append((node.lineno, name))
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            named = any(
                isinstance(s, ast.Attribute) and s.attr in NAMED_BY_COMPARISON for s in sides
            )
            for side in sides:
                if named and (name := _literal(side)) in names:
                    found.append((node.lineno, name))
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value in workflows
        ):
            found.append((node.lineno, node.value))
    return found


def test_no_temporal_name_is_typed_outside_its_one_place() -> None:
    names = _torchpass_names()
    typed = {
        f"{p.relative_to(ROOT)}:{line}": name
        for top in SOURCES
        for p in sorted((ROOT / top).rglob("*.py"))
        if p != NAMES_MODULE
        for line, name in _typed_names(ast.parse(p.read_text()), names)
    }
    assert not typed, f"use the constant of torchpass.ids instead: {typed}"


def test_the_check_finds_a_name_typed_as_a_literal() -> None:
    """The check itself can fail: each way a name can be typed is caught, a constant is not."""
    names = _torchpass_names()
    typed = [
        'await handle.signal("report", rep)',
        'await h.execute_update(\n    "record_validation", report\n)',
        '@workflow.signal(name="record_outcome")\ndef f(): ...',
        'client.start_workflow("MigrationWorkflow", rep, start_signal="report")',
        'ok = a.signal_name == "record_outcome"',
        'WORKFLOWS = ("EnvironmentValidationWorkflow",)',
    ]
    for source in typed:
        assert _typed_names(ast.parse(source), names), source
    fine = 'await handle.signal(IncidentMessage.REPORT, rep); x = {"status": 1}; y = "report"'
    assert _typed_names(ast.parse(fine), names) == []
