"""Publication in one process: join, commit checks, and nothing left behind on failure."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest
from support.cache_helpers import Workers, publish_files
from support.cache_worker import identity_for
from dlo_contract.cache import (
    CacheError,
    CacheLockTimeout,
    CacheRoot,
    FileRecord,
    begin_publication,
    entry_id,
    find_entry,
    open_entry,
    read_manifest,
    runtime_identity,
    verify_entry,
)
from dlo_contract.cache.locks import try_lock

IDENT = runtime_identity({"tp_world_size": 1, "tp_rank": 0}, "12" * 32)
ENTRY = entry_id(IDENT)


def _leftovers(root: CacheRoot) -> list[str]:
    return sorted(os.listdir(root.tmp)) + sorted(os.listdir(root.entries))


def test_publish_then_join_then_open(root: CacheRoot) -> None:
    files = {"transformer/config.json": b"{}", "transformer/w.safetensors": b"w" * 3000}
    entry = publish_files(root, "s3://b/m/", files)
    path = find_entry(root, entry, verify="full")
    assert path == root.entry_dir(entry)
    manifest = read_manifest(path / "manifest.json")
    assert (manifest.kind, manifest.total_bytes, manifest.entry_id) == ("checkpoint", 3002, entry)
    assert stat.S_IMODE(os.stat(path / "transformer/w.safetensors").st_mode) == 0o444
    with begin_publication(root, entry, expected_bytes=3002, lock_timeout_s=1) as pub:
        assert (pub.existing, pub.tmp_dir) == (path, None)
    with open_entry(root, entry, verify="full") as handle:
        assert handle.file_path("transformer/config.json").read_bytes() == b"{}"
        with pytest.raises(CacheError) as info:
            handle.file_path("other.bin")
        assert str(info.value) == f"cache entry {entry} has no file 'other.bin'"
    assert handle.closed
    assert os.listdir(root.tmp) == []


def test_an_exception_while_writing_leaves_no_entry_no_tmp_and_a_free_lock(root: CacheRoot) -> None:
    with (
        pytest.raises(ValueError, match="writer gave up"),
        begin_publication(root, ENTRY, expected_bytes=10, lock_timeout_s=1) as pub,
    ):
        (pub.tmp_dir / "w.bin").write_bytes(b"x" * 10)
        raise ValueError("writer gave up")
    assert _leftovers(root) == []
    held = try_lock(root.publish_lock(ENTRY))
    assert held is not None
    held.release()


@pytest.mark.parametrize(
    ("setup", "records", "reason"),
    [
        (
            "symlink",
            [FileRecord("w.bin", 4)],
            "w.bin is a symbolic link; entries hold regular files only",
        ),
        (
            "dirlink",
            [FileRecord("d/w.bin", 4)],
            "d is a symbolic link; entries hold regular files only",
        ),
        ("plain", [FileRecord("w.bin", 5)], "w.bin has 4 bytes, its record says 5"),
        (
            "plain",
            [FileRecord("w.bin", 4), FileRecord("x.bin", 1)],
            "x.bin is listed but was not written",
        ),
        ("plain", [], "w.bin was written but is not in the file list"),
        ("plain", [FileRecord("w.bin", 4), FileRecord("w.bin", 4)], "w.bin is listed twice"),
    ],
)
def test_commit_refuses_what_the_manifest_would_not_describe(
    root: CacheRoot, tmp_path: Path, setup: str, records: list[FileRecord], reason: str
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "w.bin").write_bytes(b"evil")
    with (
        pytest.raises(CacheError) as info,
        begin_publication(root, ENTRY, expected_bytes=4, lock_timeout_s=1) as pub,
    ):
        if setup == "symlink":
            (pub.tmp_dir / "w.bin").symlink_to(outside / "w.bin")
        elif setup == "dirlink":
            (pub.tmp_dir / "d").symlink_to(outside)
        else:
            (pub.tmp_dir / "w.bin").write_bytes(b"good")
        pub.commit("runtime", IDENT, records)
    assert str(info.value) == f"cannot publish cache entry {ENTRY}: {reason}"
    assert _leftovers(root) == []


def test_commit_refuses_an_identity_of_another_id(root: CacheRoot) -> None:
    other = runtime_identity({"tp_world_size": 1, "tp_rank": 1}, "12" * 32)
    with (
        pytest.raises(CacheError) as info,
        begin_publication(root, ENTRY, expected_bytes=0, lock_timeout_s=1) as pub,
    ):
        pub.commit("runtime", other, [])
    assert str(info.value) == (
        f"identity hashes to {entry_id(other)}, not to the entry being published {ENTRY}"
    )
    assert _leftovers(root) == []


def test_an_invalid_entry_is_replaced_by_the_next_publication(root: CacheRoot) -> None:
    entry = publish_files(root, "s3://b/m/", {"w.bin": b"a" * 100})
    os.truncate(root.entry_dir(entry) / "w.bin", 10)
    assert find_entry(root, entry) is None
    assert publish_files(root, "s3://b/m/", {"w.bin": b"a" * 100}) == entry
    assert verify_entry(root, entry, full=True) == []
    assert os.listdir(root.tmp) == []


def test_waiting_for_a_held_publish_lock_is_bounded(
    root: CacheRoot, workers: Workers, tmp_path: Path
) -> None:
    marker = tmp_path / "holding"
    seed = "held"
    holder = workers.start("hold-publish", str(root.path), seed, "--marker", str(marker))
    workers.wait_for(marker, holder)
    entry = entry_id(identity_for(seed))
    with (
        pytest.raises(CacheLockTimeout) as info,
        begin_publication(root, entry, expected_bytes=1, lock_timeout_s=0.2),
    ):
        pass
    assert str(info.value) == (
        f"timed out after 0.2 s waiting for the publish lock {root.locks}/{entry}.publish"
    )
    assert info.value.hint == "another process holds it; retry later or raise the lock timeout"
    assert Workers.result(holder) == {"held": True}
    with begin_publication(root, entry, expected_bytes=1, lock_timeout_s=1) as pub:
        assert pub.tmp_dir is not None


def test_a_publisher_not_allowed_to_create_its_lock_is_told_who_owns_the_root(
        root: CacheRoot, monkeypatch: pytest.MonkeyPatch) -> None:
    """A runtime-cache publisher running as another user than the loader that laid the root
    out: the error says permission was refused and whose the directory is, not that a file is
    missing."""
    real_open = os.open

    def refused(path: str, flags: int, *args: int) -> int:
        if flags & os.O_CREAT:
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real_open(path, flags, *args)

    root.ensure()
    monkeypatch.setattr(os, "open", refused)
    entry = entry_id(identity_for("not mine"))
    with pytest.raises(CacheError) as info:
        with begin_publication(root, entry, expected_bytes=10, lock_timeout_s=1):
            pass
    assert str(info.value) == (
        f"cannot create lock file {root.publish_lock(entry)}: Permission denied ({root.locks} is "
        f"owned by uid {os.stat(root.locks).st_uid}, this process runs as uid {os.geteuid()})")
    assert "run it as the owner of the cache root, or give it its own root" in info.value.hint
