"""Listing entries and evicting the least recently used ones.

Owns the cache's housekeeping: `list_entries` (kind, bytes, last use, in use), `evict` (LRU
removal until the root is under its byte limit and above its free-space floor, counting an
entry about to be written and the publications in progress, never touching an entry whose
`.use` lock is held or whose id is being published), `over_limits` (the one limit check, also
`room`'s and `dlo cache gc`'s verdict) and the sweep of leftovers whose owner is gone (tmp
dirs, lock files of vanished entries, reservations of dead publishers). Called by `dlo cache gc`, `dlo cache ls`
and by `room` before every publication. Must not write entries or decide what a valid entry is
(that is `manifest` and `check`), nor whether a publication may start (that is `room`).

Last use is the mtime of `locks/<id>.use`, touched by every `open_entry`; an entry never opened
counts from its publication.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from dlo_contract.cache import locks
from dlo_contract.cache.entry import RootLike
from dlo_contract.cache.errors import CacheCorruptError
from dlo_contract.cache.fsutil import free_bytes, fsync_dir, remove_tree, tree_bytes
from dlo_contract.cache.layout import CacheRoot, check_entry_id, is_entry_id
from dlo_contract.cache.manifest import read_manifest
from dlo_contract.cache.reservation import FillInProgress, reclaim_dead

log = logging.getLogger(__name__)
INVALID_KIND = "invalid"
"""`EntryInfo.kind` of a directory whose manifest is missing or unreadable."""


@dataclass(frozen=True, kw_only=True)
class EntryInfo:
    entry_id: str
    kind: str
    """`checkpoint`, `runtime`, or `invalid` (no usable manifest)."""
    bytes: int
    last_used: float
    """Seconds since the epoch of the last `open_entry` (or of publication)."""
    in_use: bool
    """Some process holds the entry's `.use` lock right now."""


def _entry_info(cache: CacheRoot, entry_id: str) -> EntryInfo | None:
    directory = cache.entry_dir(entry_id)
    try:
        manifest = read_manifest(cache.manifest_path(entry_id))
        kind, size = manifest.kind, manifest.total_bytes
    except (FileNotFoundError, NotADirectoryError, CacheCorruptError):
        kind, size = INVALID_KIND, tree_bytes(directory)
    last_used = _last_used(cache, entry_id)
    if last_used is None:
        return None  # evicted while we looked
    return EntryInfo(
        entry_id=entry_id, kind=kind, bytes=size, last_used=last_used,
        in_use=locks.is_locked(cache.use_lock(entry_id)),
    )


def _last_used(cache: CacheRoot, entry_id: str) -> float | None:
    """mtime of `.use` (touched on open), else of the manifest or directory (publication)."""
    paths = (cache.use_lock(entry_id), cache.manifest_path(entry_id), cache.entry_dir(entry_id))
    for candidate in paths:
        try:
            return os.stat(candidate).st_mtime
        except FileNotFoundError:
            continue
    return None


def list_entries(root: RootLike) -> list[EntryInfo]:
    """Every entry directory under the root, least recently used first."""
    cache = CacheRoot.of(root)
    infos = [info for i in cache.entry_ids() if (info := _entry_info(cache, i)) is not None]
    return sorted(infos, key=lambda info: (info.last_used, info.entry_id))


def over_limits(cache: CacheRoot, total: int, max_bytes: int, min_free_bytes: int,
                 incoming_bytes: int = 0, others: Sequence[FillInProgress] = ()) -> bool:
    """Whether `total` bytes of entries, plus `incoming_bytes` and what the publications in
    progress (`others`) reserved, break `max_bytes`, or the free space less what all of them
    have yet to write breaks `min_free_bytes`: the one limit check."""
    reserved = sum(other.bytes for other in others)
    if max_bytes > 0 and total + incoming_bytes + reserved > max_bytes:
        return True
    if min_free_bytes <= 0 and incoming_bytes <= 0:
        return False
    unwritten = sum(other.unwritten for other in others)
    return free_bytes(cache.entries) - incoming_bytes - unwritten < min_free_bytes


def evict(
    root: RootLike, *, max_bytes: int, min_free_bytes: int, keep: Iterable[str] = (),
    incoming_bytes: int = 0, others: Sequence[FillInProgress] = (),
) -> list[str]:
    """Remove least recently used entries (invalid ones first) until the total plus
    `incoming_bytes` (an entry about to be written) and the reservations of `others`
    (publications in progress) is at most `max_bytes` (0: no limit) and at least
    `min_free_bytes` stay free once all are written (0: no floor). Entries in use, being
    published, or listed in `keep` stay. Returns the removed ids in removal order."""
    cache = CacheRoot.of(root)
    if not cache.entries.is_dir():
        return []
    sweep_leftovers(cache)
    return evict_listed(cache, list_entries(cache), max_bytes=max_bytes,
                        min_free_bytes=min_free_bytes, keep=keep, incoming_bytes=incoming_bytes,
                        others=others)


def evict_listed(
    cache: CacheRoot, infos: Sequence[EntryInfo], *, max_bytes: int, min_free_bytes: int,
    keep: Iterable[str] = (), incoming_bytes: int = 0, others: Sequence[FillInProgress] = (),
) -> list[str]:
    """`evict` over `infos`, the caller's fresh `list_entries` after `sweep_leftovers` (`room`
    keeps the listing for its decision instead of walking the entries again)."""
    kept = set(keep)
    total = sum(info.bytes for info in infos)
    removed: list[str] = []
    for info in sorted(infos, key=lambda i: (i.kind != INVALID_KIND, i.last_used, i.entry_id)):
        if not over_limits(cache, total, max_bytes, min_free_bytes, incoming_bytes, others):
            break
        if info.entry_id in kept or not remove_entry(cache, info.entry_id):
            continue
        total -= info.bytes
        removed.append(info.entry_id)
    # Whether the limits now hold is the caller's to say: `room` decides again and waits or
    # raises naming what takes the room (polling, so a line here would repeat every poll),
    # and `dlo cache gc` prints its verdict.
    return removed


def remove_entry(root: RootLike, entry_id: str) -> bool:
    """Remove one entry unless it is in use or being published; True when it was removed."""
    cache = CacheRoot.of(root)
    check_entry_id(entry_id)
    # Holding `.publish` keeps a writer from replacing this id while we take it apart.
    publishing = locks.try_lock(cache.publish_lock(entry_id))
    if publishing is None:
        return False
    with publishing:
        # Exclusive `.use`, never waiting: any reader's shared hold means "in use, skip it".
        using = locks.try_lock(cache.use_lock(entry_id))
        if using is None:
            return False
        with using:
            away = cache.new_tmp_dir_path(entry_id, tag="evict-")
            try:
                # Rename first: a reader sees the whole entry or none of it, never a half.
                os.rename(cache.entry_dir(entry_id), away)
            except FileNotFoundError:
                return False
            fsync_dir(cache.entries)  # a crash must not bring back a half-removed entry
            _unlink(cache.use_lock(entry_id))  # safe while held: lockers re-check the inode
        remove_tree(away)
        _unlink(cache.publish_lock(entry_id))
    log.info("evicted cache entry %s", entry_id)
    return True


def sweep_leftovers(root: RootLike) -> None:
    """Remove tmp dirs whose writer is gone and lock files of entries that no longer exist.
    Each removal happens under the id's `.publish` lock, as the publication protocol requires."""
    cache = CacheRoot.of(root)
    reclaim_dead(cache)
    ids = {path.name.split(".", 1)[0] for path in cache.tmp_dirs()}
    with contextlib.suppress(FileNotFoundError):
        ids |= {name.rsplit(".", 1)[0] for name in os.listdir(cache.locks)}
    existing = set(cache.entry_ids())
    for entry_id in sorted(i for i in ids if is_entry_id(i)):
        _sweep_id(cache, entry_id, entry_id in existing)


def _sweep_id(cache: CacheRoot, entry_id: str, exists: bool) -> None:
    # Only the `.publish` holder may remove tmp dirs: a live writer still holds it.
    publishing = locks.try_lock(cache.publish_lock(entry_id))
    if publishing is None:
        return  # a live writer owns this id's tmp dir
    with publishing:
        for stale in cache.tmp_dirs(entry_id):
            log.info("removing leftover temporary directory %s", stale)
            remove_tree(stale)
        if exists or cache.entry_dir(entry_id).exists():
            return
        # A reader still holding `.use` of a vanished entry keeps its lock file.
        using = locks.try_lock(cache.use_lock(entry_id))
        if using is not None:
            with using:
                _unlink(cache.use_lock(entry_id))
        _unlink(cache.publish_lock(entry_id))


def _unlink(path: os.PathLike[str]) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
