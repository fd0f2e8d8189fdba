"""Version numbers as the environment checks compare them: release numbers only, PEP 440-style
clauses."""

from __future__ import annotations

import re

SUPPORTED_TORCH = ">=2.6,<3"
"""The torch range torchpass supports; the same as pyproject's dependency (a unit test keeps them
equal)."""

_RELEASE = re.compile(r"^\s*v?(\d+(?:\.\d+)*)")
_CLAUSE = re.compile(r"^\s*(>=|<=|==|!=|>|<)\s*(\S+)\s*$")


def parse_version(text: str) -> tuple[int, ...]:
    """The release numbers of a version: '2.13.0+cpu' -> (2, 13, 0); local and pre-release tags
    dropped."""
    m = _RELEASE.match(text)
    if m is None:
        raise ValueError(f"not a version: {text!r}")
    return tuple(int(p) for p in m.group(1).split("."))


def version_in_range(version: str, spec: str = SUPPORTED_TORCH) -> bool:
    """Whether `version` satisfies every clause of `spec` (a comma-separated '>=2.6,<3')."""
    v = parse_version(version)
    for clause in spec.split(","):
        m = _CLAUSE.match(clause)
        if m is None:
            raise ValueError(f"bad version clause {clause!r} in {spec!r}")
        op, bound = m.group(1), parse_version(m.group(2))
        width = max(len(v), len(bound))
        a, b = v + (0,) * (width - len(v)), bound + (0,) * (width - len(bound))
        ok = {">=": a >= b, "<=": a <= b, ">": a > b, "<": a < b, "==": a == b, "!=": a != b}[op]
        if not ok:
            return False
    return True
