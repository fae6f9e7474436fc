"""Small filesystem primitives the cache needs in several places.

Owns directory fsync, whole-tree removal, free-space, tree-size and allocation measurement.
Called by `publish`, `evict` and `reservation`. Must not know about entries, manifests or locks.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
"""Write failures that mean "no room": a full disk, a quota, or a file-size limit."""


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    """Make a file's data durable (an O_RDONLY descriptor is enough for fsync on Linux)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_tree(path: Path) -> None:
    """Remove a directory tree that may already be gone, or a file found in its place."""
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        pass
    except NotADirectoryError:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on `path`'s filesystem."""
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


def tree_bytes(path: Path) -> int:
    """Apparent size of the regular files under `path` (0 when it is gone)."""
    return sum(info.st_size for info in _file_stats(path))


def allocated_bytes(path: Path) -> int:
    """Disk space the regular files under `path` take now (their allocated blocks: a file
    preallocated at its full size counts in full, a sparse one only where written)."""
    return sum(info.st_blocks * 512 for info in _file_stats(path))


def _file_stats(path: Path) -> Iterator[os.stat_result]:
    """`lstat` of every file under `path`, skipping those removed while the walk runs."""
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            try:
                yield os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
