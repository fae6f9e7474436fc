"""Sealing the files a writer left in a tmp dir before they become an entry.

Owns the commit-time checks on the writer's output: every listed file exists as a regular file
of the recorded size, nothing else was written, no symbolic link hides anywhere (a link could
point outside the entry), digests are filled in where the writer gave none, and every file is
fsynced and made read-only. Called by `publish.Publication.commit` only. Must not rename,
write the manifest, or take locks.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path

from dlo_contract.cache.digest import file_record
from dlo_contract.cache.errors import CacheError
from dlo_contract.cache.fsutil import fsync_dir, fsync_file
from dlo_contract.cache.layout import safe_relpath
from dlo_contract.cache.manifest import FileRecord


def seal_files(
    tmp: Path, entry_id: str, files: Sequence[FileRecord], *, chunk_bytes: int
) -> tuple[FileRecord, ...]:
    """Check, complete, fsync and freeze the files; return the records for the manifest."""
    by_name: dict[str, FileRecord] = {}
    for record in files:
        name = safe_relpath(record.name)
        if name in by_name:
            raise _refuse(entry_id, f"{name} is listed twice")
        by_name[name] = record
    _check_tree(tmp, entry_id, set(by_name))
    sealed = []
    for name, record in by_name.items():
        path = tmp / name
        size = os.lstat(path).st_size
        if size != record.size:
            raise _refuse(entry_id, f"{name} has {size} bytes, its record says {record.size}")
        if not record.has_digests:
            record = file_record(path, name, chunk_bytes=chunk_bytes)
        fsync_file(path)  # file data must be durable before the manifest that vouches for it
        os.chmod(path, 0o444)
        sealed.append(record)
    for dirpath, _, _ in os.walk(tmp):
        fsync_dir(Path(dirpath))  # subdirectory entries must survive a crash too
    return tuple(sealed)


def _check_tree(tmp: Path, entry_id: str, listed: set[str]) -> None:
    """Walk tmp without following links: only listed regular files and plain directories."""
    found: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(tmp):
        relative = Path(dirpath).relative_to(tmp)
        for name in dirnames + filenames:
            rel = (relative / name).as_posix()
            mode = os.lstat(os.path.join(dirpath, name)).st_mode
            if stat.S_ISLNK(mode):
                raise _refuse(
                    entry_id, f"{rel} is a symbolic link; entries hold regular files only"
                )
            if name in filenames and not stat.S_ISREG(mode):
                raise _refuse(entry_id, f"{rel} is not a regular file")
            if name in filenames:
                found.add(rel)
    missing = sorted(listed - found)
    if missing:
        raise _refuse(entry_id, f"{missing[0]} is listed but was not written")
    extra = sorted(found - listed)
    if extra:
        raise _refuse(entry_id, f"{extra[0]} was written but is not in the file list")


def _refuse(entry_id: str, reason: str) -> CacheError:
    return CacheError(f"cannot publish cache entry {entry_id}: {reason}")
