"""The generated parts of docs/architecture.md: the layers as the import contracts in pyproject.toml
draw them, and every module of the packages with the first sentence of its docstring.

`python -m tests.architecture_map` rewrites them in place (between their `<!-- generated: ... -->`
markers); `tests/unit/test_architecture_doc.py` fails when the page and the tree disagree.
"""

from __future__ import annotations

import ast
import itertools
import re
import sys
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("torchpass", "job_agent", "activities", "workflows", "workers")


def _contracts() -> list[dict[str, Any]]:
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return list(tool["contracts"])


def _node(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", name)


def layers_diagram() -> str:
    """One Mermaid flowchart per layers contract: each layer a row of its modules, an arrow down to
    the layer below it may import ("|": siblings independent of each other; ":" they may import each
    other)."""
    out = []
    for c in _contracts():
        if c["type"] != "layers":
            continue
        containers = list(c.get("containers", [])) or [""]
        prefix = f"{containers[0]}." if containers[0] else ""
        out += [f"**{c['name']}**", "", "```mermaid", "flowchart TD"]
        rows = []
        for i, layer in enumerate(c["layers"]):
            sep = "|" if "|" in layer else ":"
            names = [n.strip() for n in layer.split(sep)]
            row = _node(f"{prefix}L{i}")
            label = " independent" if sep == "|" and len(names) > 1 else ""
            out.append(f'  subgraph {row}["{label.strip() or " "}"]')
            out.append("    direction LR")
            out += [f'    {_node(prefix + n)}["{prefix}{n}"]' for n in names]
            out.append("  end")
            rows.append(row)
        out += [f"  {a} --> {b}" for a, b in itertools.pairwise(rows)]
        out += ["```", ""]
    return "\n".join(out).rstrip() + "\n"


def _first_sentence(doc: str) -> str:
    """Its docstring's first sentence (of its first paragraph), as a table cell."""
    text = " ".join(doc.split("\n\n", 1)[0].split())
    m = re.match(r"(.+?[.!?])(\s|$)", text)
    sentence = m.group(1) if m else text
    return sentence.replace("|", "\\|")


def modules_table() -> str:
    """Every module of every package, by folder, with its docstring's first sentence."""
    out = []
    for top in PACKAGES:
        for folder in sorted({p.parent for p in (ROOT / top).rglob("*.py")}):
            rows = []
            for p in sorted(folder.glob("*.py")):
                doc = ast.get_docstring(ast.parse(p.read_text())) or ""
                if p.name == "__init__.py" and not doc:
                    continue
                rows.append(f"| `{p.relative_to(ROOT)}` | {_first_sentence(doc) if doc else ''} |")
            if rows:
                out += [
                    f"**`{folder.relative_to(ROOT)}/`**",
                    "",
                    "| module | what it holds |",
                    "|---|---|",
                ]
                out += [*rows, ""]
    return "\n".join(out).rstrip() + "\n"


SECTIONS = {"layers": layers_diagram, "modules": modules_table}


def render(page: str) -> str:
    """`page` with each generated section made anew."""
    for name, make in SECTIONS.items():
        begin, end = f"<!-- generated: {name} -->", f"<!-- end generated: {name} -->"
        pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
        if not pattern.search(page):
            raise ValueError(f"{DOC.name} has no '{begin}' ... '{end}' section")
        section = f"{begin}\n{make()}{end}"
        page = pattern.sub(section.replace("\\", "\\\\"), page)
    return page


if __name__ == "__main__":
    page = DOC.read_text()
    new = render(page)
    if new != page:
        DOC.write_text(new)
        print(f"{DOC.relative_to(ROOT)} rewritten", file=sys.stderr)
