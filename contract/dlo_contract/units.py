"""Byte counts and ETAs as people read them, in the loader's progress lines and the operator's
status.

Owns `human_bytes`, the one spelling of a byte count in binary units, and `human_eta`, the one
spelling of a time left, so a figure the loader logs and the one the DOD status shows read alike. Called by the loader (`progress`, `transfer`) and
the operator (`progress`). Pure; imports nothing.
"""

from __future__ import annotations

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")
ETA_MAX_S = 24 * 3600.0
"""Longest time left shown as a figure: a trickle of bytes must not promise a date months away."""


def human_bytes(count: float) -> str:
    """`1536` -> `1.5 KiB`; `100` -> `100 B`."""
    value, unit = float(count), _UNITS[0]
    for larger in _UNITS[1:]:
        if abs(value) < 1024:
            break
        value, unit = value / 1024, larger
    return f"{value:.0f} B" if unit == "B" else f"{value:.1f} {unit}"


def human_eta(seconds: float) -> str:
    """`7` -> `7 s`; `250` -> `4 min`; `14000` -> `3.9 h`; past `ETA_MAX_S`: `over 24 h`."""
    if seconds > ETA_MAX_S:
        return f"over {ETA_MAX_S / 3600:.0f} h"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
