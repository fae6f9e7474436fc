"""Byte counts as people read them, in the loader's progress lines and the operator's status.

Owns `human_bytes`, the one spelling of a byte count in binary units, so a figure the loader logs
and the one the DOD status shows read alike. Called by the loader (`progress`, `transfer`) and
the operator (`progress`). Pure; imports nothing.
"""

from __future__ import annotations

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def human_bytes(count: float) -> str:
    """`1536` -> `1.5 KiB`; `100` -> `100 B`."""
    value, unit = float(count), _UNITS[0]
    for larger in _UNITS[1:]:
        if abs(value) < 1024:
            break
        value, unit = value / 1024, larger
    return f"{value:.0f} B" if unit == "B" else f"{value:.1f} {unit}"
