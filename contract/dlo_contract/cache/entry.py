"""Finding, verifying and opening published entries (the reader's side).

Owns `find_entry` (is a valid entry there?), `verify_entry` (every problem, for `dlo cache
verify`) and `open_entry` (hold the `.use` lock shared for as long as the entry is mapped, and
record its last use). Called by the loader (is the checkpoint cached already?), the runtime (map
it) and the CLI. Must not write into entries, repair them or remove them: that is `publish` and
`evict`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Literal

from dlo_contract.cache import locks
from dlo_contract.cache.check import Problem, check_files, check_manifest
from dlo_contract.cache.errors import CacheCorruptError, CacheError, remove_command
from dlo_contract.cache.layout import MANIFEST_NAME, CacheRoot, safe_relpath
from dlo_contract.cache.manifest import Manifest, read_manifest

log = logging.getLogger(__name__)
VerifyMode = Literal["sizes", "full"]
RootLike = CacheRoot | str | os.PathLike[str]
DEFAULT_USE_LOCK_TIMEOUT_S = 30.0
"""Readers only ever wait for an evictor's brief exclusive hold (rename, not delete)."""


def _full(verify: str) -> bool:
    if verify not in ("sizes", "full"):
        raise CacheError(f"cache verify mode {verify!r} is not one of 'sizes', 'full'")
    return verify == "full"


def inspect_entry(
    root: RootLike, entry_id: str, *, full: bool
) -> tuple[Manifest | None, list[Problem]]:
    """Read the manifest and check the files; (None, [problem]) when the manifest is unusable."""
    cache = CacheRoot.of(root)
    try:
        manifest = read_manifest(cache.manifest_path(entry_id))
    except FileNotFoundError:
        return None, [Problem(MANIFEST_NAME, None, "missing (the entry is incomplete or absent)")]
    except CacheCorruptError as exc:
        return None, [Problem(MANIFEST_NAME, None, str(exc))]
    problems = check_manifest(manifest, entry_id)
    if not problems:
        problems = check_files(cache.entry_dir(entry_id), manifest, full=full)
    return manifest, problems


def verify_entry(root: RootLike, entry_id: str, full: bool = False) -> list[Problem]:
    """Every problem of an entry (empty list = good). Raises `CacheError` if it does not exist."""
    cache = CacheRoot.of(root)
    if not cache.entry_dir(entry_id).is_dir():
        raise _not_found(cache, entry_id)
    return inspect_entry(cache, entry_id, full=full)[1]


def find_entry(root: RootLike, entry_id: str, verify: VerifyMode = "sizes") -> Path | None:
    """The entry's directory when it is complete and valid, else None (a bad one is logged)."""
    cache = CacheRoot.of(root)
    full = _full(verify)
    if not cache.entry_dir(entry_id).is_dir():
        return None
    manifest, problems = inspect_entry(cache, entry_id, full=full)
    if problems:
        log.warning("cache entry %s is not usable: %s", entry_id, problems[0])
        return None
    return cache.entry_dir(entry_id)


class EntryHandle:
    """An open entry: its files stay in place while the handle holds `.use` shared."""

    def __init__(self, root: CacheRoot, entry_id: str, manifest: Manifest, lock: locks.FileLock):
        self.root = root
        self.entry_id = entry_id
        self.path = root.entry_dir(entry_id)
        self.manifest = manifest
        self._lock: locks.FileLock | None = lock

    def file_path(self, name: str) -> Path:
        """Path of one listed file; unlisted or unsafe names raise `CacheError`."""
        if self.manifest.file(safe_relpath(name)) is None:
            raise CacheError(f"cache entry {self.entry_id} has no file {name!r}")
        return self.path / name

    @property
    def closed(self) -> bool:
        return self._lock is None

    def close(self) -> None:
        """Release `.use`; after this, eviction may remove the files (unmap them first)."""
        if self._lock is not None:
            lock, self._lock = self._lock, None
            lock.release()

    def __enter__(self) -> EntryHandle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def open_entry(
    root: RootLike,
    entry_id: str,
    verify: VerifyMode = "sizes",
    *,
    lock_timeout_s: float = DEFAULT_USE_LOCK_TIMEOUT_S,
) -> EntryHandle:
    """Open a published entry for reading; raises `CacheError` when absent, `CacheCorruptError`
    when it fails verification. The caller must `close()` (or use `with`) after unmapping."""
    cache = CacheRoot.of(root)
    full = _full(verify)
    if not cache.manifest_path(entry_id).is_file():
        raise _not_found(cache, entry_id)
    # Shared `.use` before checking: an evictor needs it exclusively, so from here on the files
    # cannot disappear under the caller's mappings.
    lock = locks.lock(cache.use_lock(entry_id), shared=True, timeout_s=lock_timeout_s, what="use")
    try:
        if not cache.manifest_path(entry_id).is_file():
            raise _not_found(cache, entry_id)
        manifest, problems = inspect_entry(cache, entry_id, full=full)
        if problems or manifest is None:
            raise CacheCorruptError(
                f"cache entry {entry_id} is corrupt: {problems[0]}",
                hint=f"run: dlo cache verify --full {entry_id}; remove it with: "
                     f"{remove_command(entry_id, cache.path)}",
            )
    except BaseException:
        lock.release()
        raise
    lock.touch()  # last use, so eviction removes cold entries before this one
    return EntryHandle(cache, entry_id, manifest, lock)


def _not_found(cache: CacheRoot, entry_id: str) -> CacheError:
    return CacheError(
        f"cache entry {entry_id} not found in {cache.path}",
        hint="list entries with: dlo cache ls --root " + str(cache.path),
    )
