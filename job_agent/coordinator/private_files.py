"""Files in a job's state directory, its owner's alone: every one the job writes there is opened
here, 0600 and never through a link (docs/security.md)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, TextIO

OWNER_ONLY = 0o600

_HOW = {"w": os.O_TRUNC, "a": os.O_APPEND, "x": os.O_EXCL}


def open_private(path: Path, how: Literal["w", "a", "x"] = "w") -> TextIO:
    """`path` opened for writing text, readable and writable by its owner only: "w" truncates it,
    "a" appends to it, "x" creates it or raises `FileExistsError`. A link planted at `path` is never
    followed (`OSError`, ELOOP), and a file an older version left readable by others is narrowed to
    0600 before anything is written."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | _HOW[how], OWNER_ONLY)
    try:
        os.fchmod(fd, OWNER_ONLY)
        return os.fdopen(fd, "a" if how == "a" else "w")
    except BaseException:
        os.close(fd)
        raise


def replace_private(path: Path, text: str) -> None:
    """`path` holds `text`, owner-only, replaced atomically: a crash mid-write leaves its previous
    content."""
    tmp = path.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    with open_private(tmp, "x") as f:
        f.write(text)
    os.replace(tmp, path)
