"""The cold-start benchmark's cold cache: evicting a file leaves none of it resident, reading it
brings it back, and mincore counts both."""

from __future__ import annotations

import os
from pathlib import Path

from dlo_bench import page_cache


def test_evict_then_read(tmp_path: Path) -> None:
    data = tmp_path / "d" / "weights.bin"
    data.parent.mkdir()
    data.write_bytes(os.urandom(4 << 20))
    assert page_cache.evict([tmp_path]) == 4 << 20
    assert page_cache.resident_bytes([tmp_path]) == 0
    data.read_bytes()
    assert page_cache.resident_bytes([data]) == 4 << 20


def test_missing_paths_hold_nothing(tmp_path: Path) -> None:
    assert page_cache.files_under([tmp_path / "absent"]) == []
    assert page_cache.evict([tmp_path / "absent"]) == 0
