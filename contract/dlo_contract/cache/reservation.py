"""Reservations: the bytes a publication in progress will add to a cache root, on record before
it writes.

Owns the reservation files `v1/reservations/<entry id>.<nonce>` (the nonce is the one of the
publication's tmp dir, so a reservation finds what its writer has allocated so far): `create`
writes one and holds it, `in_progress` lists the live ones and reclaims those of dead owners,
`Reservation.release` drops one. Called by `room` (which decides whether a new one fits, under
the root's room lock) and `evict` (the sweep of leftovers). Must not decide whether an entry
fits, evict, or touch entries.

[Note: a reservation's owner] Each reservation file is flock'ed exclusively by the process that
wrote it, for as long as it holds the reservation. The kernel drops a flock when its process
dies, SIGKILL included, so whoever can take the lock knows the owner is gone: it unlinks the
file while holding the lock. A pid alone would not do (pids are reused, and a pod's pid
namespace is not the node's). The owner recorded in the file (pid, host name) is for messages.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from dlo_contract.cache import locks
from dlo_contract.cache.fsutil import allocated_bytes
from dlo_contract.cache.layout import CacheRoot, check_entry_id

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class FillInProgress:
    """One live reservation: a publication that is writing an entry now."""

    entry_id: str
    bytes: int
    """What the publication reserved: the entry's size."""
    pid: int
    host: str
    """The owner's pid and host name (a pod's name), for messages."""
    started: float
    """Seconds since the epoch when it reserved."""
    unwritten: int = 0
    """Of `bytes`, what its tmp dir has not allocated yet: what it will still take from the
    free space."""

    def describe(self) -> str:
        return f"{self.entry_id} ({self.bytes} bytes, pid {self.pid} on {self.host})"


class Reservation:
    """A held reservation; `release()` (or leaving the `with`) removes it."""

    def __init__(self, path: Path, lock: locks.FileLock, record: FillInProgress) -> None:
        self.path = path
        self.record = record
        self._lock: locks.FileLock | None = lock

    def release(self) -> None:
        if self._lock is None:
            return
        lock, self._lock = self._lock, None
        # Unlink while holding the lock: a reclaimer that takes it next re-checks the inode
        # (`locks`) and finds the path gone, so it never removes a newer file of that name.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        lock.release()

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def create(root: CacheRoot, entry_id: str, nonce_name: str, size: int) -> Reservation:
    """Write and hold the reservation of `size` bytes for `entry_id`; `nonce_name` is the name
    of the publication's tmp dir (`<id>.<nonce>`). The caller holds the room lock."""
    check_entry_id(entry_id)
    path = root.reservations / nonce_name
    record = FillInProgress(entry_id=entry_id, bytes=size, pid=os.getpid(),
                            host=socket.gethostname(), started=time.time())
    writing = root.reservations / f".{nonce_name}"  # a dot name: never listed as a reservation
    fd = os.open(writing, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a fresh file: nobody else holds it
        data = memoryview(json.dumps(asdict(record)).encode())
        while data:
            data = data[os.write(fd, data):]
        # The rename moves the locked inode into place: a lister sees a whole record, held.
        os.rename(writing, path)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(writing)
        raise
    return Reservation(path, locks.FileLock(path, fd, shared=False), record)


def in_progress(root: CacheRoot) -> list[FillInProgress]:
    """The live reservations under the root (oldest first), with what each has yet to write;
    reservations of dead owners are removed on the way."""
    found = []
    for name, record in _live_records(root):
        unwritten = max(record.bytes - allocated_bytes(root.tmp / name), 0)
        found.append(FillInProgress(**{**asdict(record), "unwritten": unwritten}))
    return sorted(found, key=lambda r: (r.started, r.entry_id))


def reclaim_dead(root: CacheRoot) -> None:
    """Remove the reservation files whose owner is gone (see [Note: a reservation's owner]),
    without measuring the live ones' tmp dirs."""
    for _ in _live_records(root):
        pass


def _live_records(root: CacheRoot) -> Iterator[tuple[str, FillInProgress]]:
    """(file name, record) of each live reservation, reclaiming those of dead owners."""
    try:
        names = sorted(os.listdir(root.reservations))
    except FileNotFoundError:
        return
    for name in names:
        if name.startswith("."):
            continue
        record = _live_record(root, name)
        if record is not None:
            yield name, record


def _live_record(root: CacheRoot, name: str) -> FillInProgress | None:
    """The record of a live reservation; None (and the file removed) when its owner is gone."""
    path = root.reservations / name
    try:
        probe = locks.try_lock(path, create=False)
    except FileNotFoundError:
        return None  # released while we listed
    if probe is not None:
        # We got the lock: its owner has died (a live owner holds it for the reservation's
        # life), so the reservation is void. Unlink under the lock (see `Reservation.release`).
        with probe:
            log.info("reclaiming reservation %s: its owner is gone", path)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        return None
    try:
        data = json.loads(path.read_text())
        return FillInProgress(entry_id=str(data["entry_id"]), bytes=int(data["bytes"]),
                              pid=int(data["pid"]), host=str(data["host"]),
                              started=float(data["started"]))
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError):
        # Records appear whole (`create` renames them into place): this one was damaged by
        # hand. Its owner lives, so it stays; it counts for nothing.
        log.warning("reservation %s is held but unreadable; not counted", path)
        return None
