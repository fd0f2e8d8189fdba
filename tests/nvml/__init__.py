"""A fake `libnvidia-ml.so.1` for machines with no GPU: `fake_nvml.c` says what it stands for."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "fake_nvml.c"


def build(directory: Path) -> Path:
    """Compile the fake library into `directory` (under a second with gcc); its path."""
    gcc = shutil.which("gcc") or shutil.which("cc")
    assert gcc, "a C compiler builds the fake NVML library (apt-get install gcc)"
    out = directory / "libnvidia-ml.so.1"
    cmd = [
        gcc,
        "-Wall",
        "-Werror",
        "-shared",
        "-fPIC",
        "-Wl,-soname,libnvidia-ml.so.1",
        "-o",
        str(out),
        str(SOURCE),
    ]
    subprocess.run(cmd, check=True, timeout=60)
    return out
