"""A full disk or a failed write: no entry, no tmp dir, and an error with the numbers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support.cache_helpers import Workers
from support.cache_worker import identity_for
from dlo_contract.cache import (
    CacheError,
    CacheRoot,
    CacheSpaceError,
    FileRecord,
    begin_publication,
    entry_id,
    publish_entry,
)
from dlo_contract.cache.locks import try_lock

KIB = 1024
IDENT = identity_for("space")
ENTRY = entry_id(IDENT)


def _assert_nothing_left(root: CacheRoot) -> None:
    assert os.listdir(root.tmp) == []
    assert os.listdir(root.entries) == []
    lock = try_lock(root.publish_lock(ENTRY))
    assert lock is not None
    lock.release()


def test_free_space_is_checked_before_writing(tmpfs: Path) -> None:
    root = CacheRoot(tmpfs / "cache")
    with (
        pytest.raises(CacheSpaceError) as info,
        begin_publication(
            root, ENTRY, expected_bytes=800 * KIB, lock_timeout_s=1, min_free_bytes=300 * KIB
        ),
    ):
        raise AssertionError("the body must not run without space")
    assert str(info.value) == (
        f"not enough space for cache entry {ENTRY}: needs 1126400 bytes (819200 for its files + "
        f"307200 free-space floor), 1048576 bytes free in {root.path}"
    )
    assert (info.value.needed_bytes, info.value.free_bytes) == (1126400, 1048576)
    assert info.value.hint == (
        f"free space with: dlo cache gc --root {root.path} --max-bytes N, or enlarge the volume"
    )
    _assert_nothing_left(root)


def test_a_disk_filling_up_during_the_write_leaves_nothing(tmpfs: Path) -> None:
    root = CacheRoot(tmpfs / "cache")

    def write(tmp: Path) -> list[FileRecord]:
        (tmpfs / "other-tenant.bin").write_bytes(b"o" * 600 * KIB)  # takes space after the check
        (tmp / "weights.bin").write_bytes(b"w" * 600 * KIB)
        return [FileRecord("weights.bin", 600 * KIB)]

    with pytest.raises(CacheSpaceError) as info:
        publish_entry(
            root, ENTRY, "runtime", IDENT, write, expected_bytes=600 * KIB, lock_timeout_s=1
        )
    assert str(info.value) == (
        f"writing cache entry {ENTRY} failed: No space left on device; it needs 614400 bytes, "
        f"0 bytes are free in {root.path}"
    )  # measured when the write failed, not after the partial file was removed
    assert isinstance(info.value.__cause__, OSError)
    _assert_nothing_left(root)


def test_a_write_over_the_file_size_limit_fails_cleanly(root: CacheRoot, workers: Workers) -> None:
    child = workers.start(
        "publish-limited",
        str(root.path),
        "space",
        "--size",
        str(128 * KIB),
        "--fsize-limit",
        str(64 * KIB),
    )
    result = Workers.result(child)
    assert result["error"] == "CacheSpaceError"
    assert result["needed"] == 128 * KIB
    assert result["message"] == (
        f"writing cache entry {ENTRY} failed: File too large; it needs 131072 bytes, "
        f"{result['free']} bytes are free in {root.path}"
    )
    _assert_nothing_left(root)


def test_other_write_errors_become_cache_errors(root: CacheRoot) -> None:
    with (
        pytest.raises(CacheError) as info,
        begin_publication(root, ENTRY, expected_bytes=1, lock_timeout_s=1) as pub,
    ):
        os.rmdir(pub.tmp_dir)
        (pub.tmp_dir / "weights.bin").write_bytes(b"w")
    assert str(info.value) == f"writing cache entry {ENTRY} failed: No such file or directory"
    _assert_nothing_left(root)
