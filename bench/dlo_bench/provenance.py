"""Where a benchmark's figures come from: the commit and the machine.

Every benchmark's JSON carries both (see the package docstring), so they live here once. Called
by `dlo_bench.cluster`; stdlib only; it must not measure anything.
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any


def commit() -> str | None:
    """The checked-out commit (with `-dirty` for changes to tracked files), or None outside git."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain",
                                "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def _first_field(path: str, key: str) -> str | None:
    """The value of the first `key: value` line of a /proc file, or None where it is absent."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith(key)), None)


def machine() -> dict[str, Any]:
    """The hardware and software a figure was measured on."""
    memory_kib = _first_field("/proc/meminfo", "MemTotal")
    return {
        "cpu": _first_field("/proc/cpuinfo", "model name") or platform.processor(),
        "cpus": os.cpu_count(),
        "memory_gib": round(int(memory_kib.split()[0]) / 2**20, 1) if memory_kib else None,
        "system": platform.system(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }
