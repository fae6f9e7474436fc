"""Errors of the node cache.

Owns the cache's error classes, split by what the caller does next: `CacheLockTimeout` is worth a
retry (another process holds the publish lock); the others need a person or a fallback (a bad
name, a corrupt entry, a full disk). Every module of `dlo_contract.cache` raises these; the loader
and the runtime catch them to keep their fallback. Must not import anything beyond the shared
error base.
"""

from __future__ import annotations

import os

from dlo_contract.errors import PermanentError, TransientError


class CacheError(PermanentError):
    """The cache cannot do what was asked: bad name, missing entry, failed write."""


class CacheLockTimeout(TransientError):
    """Another process held an entry's lock for longer than the caller was willing to wait."""


class CacheSpaceError(CacheError):
    """The cache filesystem lacks room for an entry (or a write ran out of it)."""

    def __init__(
        self, message: str, *, needed_bytes: int, free_bytes: int, hint: str | None = None
    ) -> None:
        super().__init__(message, hint=hint)
        self.needed_bytes = needed_bytes
        self.free_bytes = free_bytes


class CacheCorruptError(CacheError):
    """An entry's manifest or files do not match what was published."""


def remove_command(entry_id: str, root: str | os.PathLike[str] | None = None) -> str:
    """The command that removes one entry unless it is in use: what errors about a damaged or
    unreadable entry tell a person to run."""
    where = f" --root {root}" if root is not None else ""
    return f"dlo cache gc{where} --remove {entry_id}"
