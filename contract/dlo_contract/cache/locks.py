"""Kernel file locks (flock) on the files under `<root>/v1/locks/`.

Owns how a lock file is opened, locked with a bounded wait, checked against the path (so a lock
file that was unlinked and recreated is never trusted), touched to record last use, and released.
Kernel locks die with their process, so a writer killed by SIGKILL never leaves a held lock.
Called by `publish` (`.publish`, exclusive), `entry` (`.use`, shared while mapped), `evict`
(`.use` exclusive, non-blocking) and the loader (`node_key`). Must not know what an entry is or
decide policy.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import time
from pathlib import Path

from dlo_contract.cache.errors import CacheError, CacheLockTimeout

log = logging.getLogger(__name__)
_POLL_S = 0.02


class FileLock:
    """A held flock on one lock file; `release()` (or leaving the `with`) drops it."""

    def __init__(self, path: Path, fd: int, shared: bool) -> None:
        self.path = path
        self.fd: int | None = fd
        self.shared = shared

    def touch(self) -> None:
        """Set the lock file's mtime to now: the cache's record of an entry's last use."""
        if self.fd is None:
            return
        try:
            os.utime(self.fd)
        except OSError as exc:
            # A read-only mount (the runtime's view of a loader-filled cache) cannot record use;
            # eviction then falls back to publication time, which is still a safe order.
            log.debug("cannot record last use on %s: %s", self.path, exc.strerror)

    def release(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)  # closing the only descriptor drops the flock

    def __enter__(self) -> FileLock:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def _open_lock_file(path: Path, create: bool) -> int:
    flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    try:
        return os.open(path, flags, 0o666)
    except OSError as exc:
        if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        refused = exc
    # Readers on a read-only mount or without write permission still lock: flock works on an
    # O_RDONLY descriptor, and the publisher created the file for them.
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        if not create:
            raise
        raise _cannot_create(path, refused) from refused


def _cannot_create(path: Path, refused: OSError) -> CacheError:
    """A lock file this process had to create and was not allowed to: say who owns the place."""
    try:
        owner = os.stat(path.parent).st_uid
    except OSError:
        owner = None
    return CacheError(
        f"cannot create lock file {path}: {refused.strerror} ({path.parent} is owned by uid "
        f"{owner}, this process runs as uid {os.geteuid()})",
        hint="a writer of this cache (a runtime cache publisher) needs a writable root it may "
             "create files in: run it as the owner of the cache root, or give it its own root",
    )


def _lock_once(path: Path, shared: bool, create: bool) -> FileLock | None:
    """One non-blocking attempt; None when someone else holds a conflicting lock."""
    try:
        fd = _open_lock_file(path, create)
    except FileNotFoundError:
        if not create:
            raise
        raise CacheError(
            f"cannot open lock file {path}: it is missing and cannot be created"
        ) from None
    except OSError as exc:
        raise CacheError(f"cannot open lock file {path}: {exc.strerror}") from exc
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    try:
        current = os.stat(path)
    except FileNotFoundError:
        current = None
    held = os.fstat(fd)
    if current is None or (current.st_dev, current.st_ino) != (held.st_dev, held.st_ino):
        # The file was unlinked (eviction) between our open and our flock: a lock on the orphan
        # inode would exclude nobody. Drop it and lock whatever the path names now.
        os.close(fd)
        return _lock_once(path, shared, create)
    return FileLock(path, fd, shared)


def try_lock(path: Path, *, shared: bool = False, create: bool = True) -> FileLock | None:
    """Take the lock now or return None (eviction and `in use` probes never wait).
    With `create=False` a missing lock file raises `FileNotFoundError`."""
    return _lock_once(path, shared, create)


def lock(
    path: Path, *, timeout_s: float, shared: bool = False, what: str = "cache", create: bool = True
) -> FileLock:
    """Take the lock, polling for at most `timeout_s` seconds.

    Polling LOCK_NB (instead of a blocking flock with an alarm) keeps the wait bounded without
    signals, which a library must not install.
    """
    deadline = time.monotonic() + max(0.0, timeout_s)
    while True:
        held = _lock_once(path, shared, create)
        if held is not None:
            return held
        if time.monotonic() >= deadline:
            raise CacheLockTimeout(
                f"timed out after {timeout_s:g} s waiting for the {what} lock {path}",
                delay_s=min(5.0, max(timeout_s, _POLL_S)),
                hint="another process holds it; retry later or raise the lock timeout",
            )
        time.sleep(_POLL_S)


def touch_file(path: Path) -> None:
    """Create `path` if needed and set its mtime to now, without locking it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        os.utime(fd)
    finally:
        os.close(fd)


def is_locked(path: Path) -> bool:
    """True when another process holds any lock on `path` (probe with LOCK_EX|LOCK_NB)."""
    try:
        probe = _lock_once(path, shared=False, create=False)
    except FileNotFoundError:
        return False
    if probe is None:
        return True
    probe.release()
    return False


_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def node_key(directory: Path) -> str:
    """A key for the node a lock directory lives on: the same for every process that sees this
    directory (every container of the node), different on another node or another cache root.
    The kernel's boot id with the directory's device and inode; fill groups take their nodes'
    publications in the order of these keys (the loader's [Note: node order])."""
    info = os.stat(directory)
    return f"{_BOOT_ID.read_text().strip()}/{info.st_dev}/{info.st_ino}"
