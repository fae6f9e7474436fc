"""Node-cache fixtures (a cache root, worker processes, a small tmpfs), imported by the conftests that use them."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.cache_helpers import Workers
from dlo_contract.cache import CacheRoot


@pytest.fixture
def root(tmp_path: Path) -> CacheRoot:
    return CacheRoot(tmp_path / "cache")


@pytest.fixture
def workers() -> Iterator[Workers]:
    pool = Workers()
    yield pool
    pool.stop_all()


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs, so "disk full" and "bytes free" are exact. Needs CAP_SYS_ADMIN."""
    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)],
            capture_output=True,
            text=True,
            check=False,
        )
    except FileNotFoundError:
        pytest.skip("cannot mount a tmpfs here: no mount command")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)
