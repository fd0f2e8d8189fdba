"""Benchmarks: ratios measured side by side in one invocation; results go to docs/benchmarks.md."""

from __future__ import annotations

import re
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def write_block(name: str, lines: list[str]) -> None:
    """Put a benchmark's block into docs/benchmarks.md between its markers, replacing the last
    run's."""
    begin, end = f"<!-- {name}: written by bench/{name}.py -->", f"<!-- /{name} -->"
    block = "\n".join([begin, *lines, end])
    text = BENCHMARKS.read_text()
    if begin in text:
        text = re.sub(re.escape(begin) + r".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    BENCHMARKS.write_text(text)


def read_step_log(log: Path) -> list[tuple[int, int, int, float, str]]:
    """A step log's rows, (rank, step, pid, unix time, "begin" | "end"), as the examples'
    `--step-log` writes them."""
    if not log.exists():
        return []
    out = []
    for line in log.read_text().splitlines():
        parts = line.split()
        if len(parts) == 5:
            out.append((int(parts[0]), int(parts[1]), int(parts[2]), float(parts[3]), parts[4]))
    return out
