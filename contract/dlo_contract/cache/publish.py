"""Publishing an entry: one writer per id, atomic appearance, nothing left behind on failure.

Owns the writer's protocol of docs/design.md section 4: take `.publish` (bounded wait) → join a
valid entry if one is there → else, as lock owner, remove stale tmp dirs of this id → reserve the
entry's bytes (`room`: evicting if asked, waiting for publications in progress; see [Note:
room]) → the caller writes into a fresh tmp dir → `commit` checks the files, fsyncs, writes the
manifest, renames tmp to `entries/<id>` and fsyncs the parent. Leaving without commit removes
the tmp dir; leaving either way drops the reservation. Called by the loader (checkpoint entries)
and the runtime cache (runtime entries). Must not evict other entries itself (`room` does, for a
caller that allows it) or read entries it does not publish (beyond the join check).

[Note: publication order] The manifest is written after every file is fsynced and the rename
happens after the manifest is fsynced, so after any crash an `entries/<id>` directory either
has a manifest describing durable files or does not exist. Only the holder of `.publish` removes
tmp dirs, and a holder's death frees the lock, so a live writer's tmp dir is never removed.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from dlo_contract.cache import locks
from dlo_contract.cache.digest import DEFAULT_CHUNK_BYTES
from dlo_contract.cache.entry import RootLike, VerifyMode, find_entry
from dlo_contract.cache.errors import CacheError, CacheSpaceError
from dlo_contract.cache.fsutil import SPACE_ERRNOS, free_bytes, fsync_dir, remove_tree, tree_bytes
from dlo_contract.cache.identity import entry_id as identity_entry_id
from dlo_contract.cache.layout import MANIFEST_NAME, CacheRoot, check_entry_id
from dlo_contract.cache.manifest import KINDS, FileRecord, Manifest
from dlo_contract.cache.reservation import Reservation
from dlo_contract.cache.room import RoomLimits, reserve, space_hint
from dlo_contract.cache.staging import seal_files
from dlo_contract.field_names import Names, document_names

log = logging.getLogger(__name__)


class Publication:
    """The state of one publication attempt; use through `begin_publication` as a context."""

    def __init__(
        self, root: RootLike, entry_id: str, *, expected_bytes: int, lock_timeout_s: float,
        min_free_bytes: int = 0, verify: VerifyMode = "sizes", room: RoomLimits | None = None,
        names: Names = document_names, prepare: Callable[[], None] | None = None,
    ) -> None:
        self.root = CacheRoot.of(root)
        self.entry_id = check_entry_id(entry_id)
        self.expected_bytes = expected_bytes
        self.lock_timeout_s = lock_timeout_s
        self.verify = verify
        self.room = room or RoomLimits(min_free_bytes=min_free_bytes, timeout_s=lock_timeout_s)
        """The limits this publication keeps, and whether it evicts (as lock owner, when there
        is no valid entry to join: a second writer of the same id waits for the lock and joins,
        so it never evicts for a copy it will not write)."""
        self.names = names
        self.prepare = prepare
        """Run as lock owner before reserving, when there is nothing to join: checks of the
        caller's own (the loader's deployment limits); may evict (through `room.make_room`)."""
        self.existing: Path | None = None
        self.tmp_dir: Path | None = None
        self.committed: Path | None = None
        self.waited_lock_s = 0.0
        """How long taking `.publish` waited (another writer of this id held it)."""
        self.waited_room_s = 0.0
        """How long reserving waited for publications in progress to leave room."""
        self._lock: locks.FileLock | None = None
        self._reservation: Reservation | None = None

    def __enter__(self) -> Publication:
        try:
            self.root.ensure()
        except OSError as exc:
            raise CacheError(
                f"cannot create the cache layout under {self.root.path}: {exc.strerror}",
                hint="the cache root must be a writable directory for publishers",
            ) from exc
        started = time.monotonic()
        # One writer per id: without it two loaders would interleave writes into one entry.
        self._lock = locks.lock(
            self.root.publish_lock(self.entry_id), timeout_s=self.lock_timeout_s, what="publish"
        )
        self.waited_lock_s = time.monotonic() - started
        try:
            self.existing = find_entry(self.root, self.entry_id, self.verify)
            if self.existing is None:
                self._clear_leftovers()
                if self.prepare is not None:
                    self.prepare()
                tmp = self.root.new_tmp_dir_path(self.entry_id)
                # Counted before a byte is written: concurrent publications of other entries
                # see it and keep the limits together (see [Note: room] in `room`).
                self._reservation, self.waited_room_s = reserve(
                    self.root, self.entry_id, tmp.name, self.expected_bytes, self.room,
                    self.names)
                tmp.mkdir(mode=0o755)
                self.tmp_dir = tmp
        except BaseException:
            self._release()
            raise
        return self

    def _clear_leftovers(self) -> None:
        """As lock owner: drop tmp dirs of dead writers and an invalid entry of this id."""
        for stale in self.root.tmp_dirs(self.entry_id):
            log.info("removing stale temporary directory %s", stale)
            remove_tree(stale)
        broken = self.root.entry_dir(self.entry_id)
        if broken.exists():
            log.warning("replacing invalid cache entry %s", broken)
            away = self.root.new_tmp_dir_path(self.entry_id, tag="invalid-")
            # Rename first: readers see the id vanish at once, never a half-deleted tree.
            os.rename(broken, away)
            remove_tree(away)

    def commit(
        self, kind: str, identity: Mapping[str, Any], files: Sequence[FileRecord], *,
        tensor_count: int | None = None, content_digest: str | None = None, producer: str = "dlo",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> Path:
        """Check the written files against `files`, then publish them atomically. Records
        without digests are hashed here (chunk lists of `chunk_bytes` above one chunk)."""
        tmp = self._writable_tmp()
        if kind not in KINDS:
            raise CacheError(f"cache entry kind {kind!r} is not one of {KINDS}")
        derived = identity_entry_id(identity)
        if derived != self.entry_id:
            raise CacheError(
                f"identity hashes to {derived}, not to the entry being published {self.entry_id}",
                hint="derive the id with dlo_contract.cache.entry_id(identity)",
            )
        if kind == "runtime" and content_digest is None:
            content_digest = identity.get("content_digest")
        records = seal_files(tmp, self.entry_id, files, chunk_bytes=chunk_bytes)
        manifest = Manifest(
            kind=kind, entry_id=self.entry_id, identity=dict(identity), files=records,
            tensor_count=tensor_count, content_digest=content_digest, producer=producer,
        )
        _write_durably(tmp / MANIFEST_NAME, manifest.to_json().encode())
        fsync_dir(tmp)  # the manifest's directory entry must be durable before the rename
        final = self.root.entry_dir(self.entry_id)
        os.rename(tmp, final)  # atomic: readers see no entry or a complete one, never a part
        self.tmp_dir, self.committed = None, final
        fsync_dir(self.root.entries)  # a crash after return must not lose the published entry
        _create_use_lock(self.root, self.entry_id)
        log.info("published cache entry %s (%d bytes)", self.entry_id, manifest.total_bytes)
        return final

    def _writable_tmp(self) -> Path:
        if self.existing is not None:
            raise CacheError(f"cache entry {self.entry_id} exists already; join it, write nothing")
        if self.tmp_dir is None:
            raise CacheError(f"publication of cache entry {self.entry_id} is not open")
        return self.tmp_dir

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: object) -> None:
        try:
            if self.tmp_dir is not None:
                written = tree_bytes(self.tmp_dir)
                free = free_bytes(self.root.tmp)  # measured while the partial files still hold it
                remove_tree(self.tmp_dir)
                self.tmp_dir = None
                if isinstance(exc, OSError):
                    raise self._write_error(exc, written, free) from exc
        finally:
            self._release()

    def _release(self) -> None:
        """Drop the reservation (the entry, if published, counts from now on), then the lock:
        only after the tmp dir is gone, as no one may see it live."""
        if self._reservation is not None:
            self._reservation.release()
            self._reservation = None
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _write_error(self, exc: OSError, written: int, free: int) -> CacheError:
        reason = exc.strerror or str(exc)
        if exc.errno not in SPACE_ERRNOS:
            return CacheError(f"writing cache entry {self.entry_id} failed: {reason}")
        needed = max(self.expected_bytes, written) + self.room.min_free_bytes
        return CacheSpaceError(
            f"writing cache entry {self.entry_id} failed: {reason}; it needs {needed} bytes, "
            f"{free} bytes are free in {self.root.path}",
            needed_bytes=needed, free_bytes=free, hint=space_hint(self.root),
        )


def begin_publication(
    root: RootLike, entry_id: str, *, expected_bytes: int, lock_timeout_s: float,
    min_free_bytes: int = 0, verify: VerifyMode = "sizes", room: RoomLimits | None = None,
    names: Names = document_names, prepare: Callable[[], None] | None = None,
) -> Publication:
    """Start publishing `entry_id`; use as `with begin_publication(...) as pub:`. `room`: the
    limits to keep and whether to evict for them (default: the free-space floor
    `min_free_bytes` only, waiting up to `lock_timeout_s` for publications in progress);
    `names` spells the settings in errors; `prepare` runs as lock owner before reserving when
    there is nothing to join."""
    return Publication(
        root, entry_id, expected_bytes=expected_bytes, lock_timeout_s=lock_timeout_s,
        min_free_bytes=min_free_bytes, verify=verify, room=room, names=names, prepare=prepare,
    )


def publish_entry(
    root: RootLike, entry_id: str, kind: str, identity: Mapping[str, Any],
    write: Callable[[Path], Sequence[FileRecord]], *, expected_bytes: int, lock_timeout_s: float,
    min_free_bytes: int = 0, tensor_count: int | None = None, content_digest: str | None = None,
    producer: str = "dlo", verify: VerifyMode = "sizes",
) -> Path:
    """Publish with `write(tmp_dir) -> records`, or join the valid entry already there."""
    with begin_publication(
        root, entry_id, expected_bytes=expected_bytes, lock_timeout_s=lock_timeout_s,
        min_free_bytes=min_free_bytes, verify=verify,
    ) as pub:
        if pub.existing is not None:
            return pub.existing
        records = write(pub._writable_tmp())
        return pub.commit(
            kind, identity, records, tensor_count=tensor_count, content_digest=content_digest,
            producer=producer,
        )


def _write_durably(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o444)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)  # the manifest is the proof of completeness: it must reach the disk
    finally:
        os.close(fd)


def _create_use_lock(root: CacheRoot, entry_id: str) -> None:
    """Create `.use` now, so readers on a read-only mount can lock it, and stamp first use."""
    try:
        locks.touch_file(root.use_lock(entry_id))
    except OSError as exc:
        log.warning("cannot create %s: %s", root.use_lock(entry_id), exc.strerror)
