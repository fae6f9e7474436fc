"""Kernel locks on lock files that eviction unlinks: a lock is only ever held on the file the
path names now."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest
from dlo_contract.cache import locks


def test_a_lock_file_unlinked_between_open_and_flock_is_locked_again_at_its_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Eviction unlinks `<id>.use` while a reader has opened it but not locked it yet, and a new
    publisher creates and holds the file of that name: the reader's flock on the orphan would
    exclude nobody, so it must find the path names another file and lock that one (held:
    None), then hold the live file once it is free."""
    path = tmp_path / "entry.use"
    path.touch()
    real_flock = fcntl.flock
    successor: list[int] = []

    def evicted_before_flock(fd: int, operation: int) -> None:
        if not successor and os.fstat(fd).st_ino == os.stat(path).st_ino:
            os.unlink(path)  # eviction, between the reader's open and its flock
            successor.append(os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666))
            real_flock(successor[0], fcntl.LOCK_EX)  # a new publisher holds the live file
        real_flock(fd, operation)

    monkeypatch.setattr(locks.fcntl, "flock", evicted_before_flock)
    assert locks.try_lock(path, shared=True) is None  # the live file is held
    os.close(successor[0])  # the publisher lets go
    held = locks.try_lock(path, shared=True)
    assert held is not None and held.fd is not None
    assert os.fstat(held.fd).st_ino == os.stat(path).st_ino  # the live file, not the orphan
    held.release()
