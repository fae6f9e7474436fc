"""`file:///path/`: a directory of the loader's machine, a mounted NFS share or volume (the
operator mounts it read-only), read with `pread` straight into the caller's buffer.

Owns `FileSource`: the listing (a walk of the directory, symbolic links followed, so a
Hugging Face cache's `snapshots/` folder reads as its files), each file's version identity
(modification time, size and inode: `identity_of`, the same on every node of a shared
filesystem, so a fill group agrees on it) and the reads, each of which opens the file and
compares its identity with the listing's before reading (another is `SourceChanged`: replaced or
rewritten mid-fill). A share publishes no checksum: the entry's chunk digests are the only
check. No stall detection: a read of a hung hard-mounted share waits in the kernel, where no
timeout reaches it (the fill's deadline still ends the fill). An I/O error of the share (EIO,
ESTALE, a soft mount's ETIMEDOUT) is retried like a reset connection. Called through
`dlo_loader.sources`. Must not write.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterable, Iterator

from dlo_loader.source_retry import StoreStatus
from dlo_loader.sources.seam import (
    ListedChecksums,
    RangedReads,
    SourceOptions,
    fill_hashed,
    matches,
    nothing_matched,
    source_changed,
)
from dlo_contract.cache import ObjectIdentity
from dlo_contract.source_uri import SourceAddress

CREDENTIALS_HINT = ("the loader reads the directory as its own user: make the files readable "
                    "to it (the pod's fsGroup or the share's export options)")
_PIECE_BYTES = 8 << 20
"""Most bytes one `pread` asks for (each piece is hashed as it lands)."""
_TRANSIENT = {errno.EIO, errno.ESTALE, errno.ETIMEDOUT, errno.EAGAIN, errno.EINTR}
"""I/O errors of a share that another attempt may not meet."""


def identity_of(info: os.stat_result) -> str:
    """A file's version identity: what changes when it is rewritten or replaced."""
    return f"{info.st_mtime_ns:x}-{info.st_size:x}-{info.st_ino:x}"


class FileSource(RangedReads, ListedChecksums):
    """The files under one directory (see the module docstring)."""

    def __init__(self, uri: SourceAddress, options: SourceOptions) -> None:
        self.uri = uri
        self.retry = options.retrier(uri, credentials=CREDENTIALS_HINT)
        self._listed, self._algorithms = {}, {}

    def close(self) -> None:
        """Nothing stays open between reads."""

    def list(self, include: Iterable[str], *, checked_bytes: int | None = None
             ) -> list[ObjectIdentity]:
        patterns = tuple(include)
        found = self.retry.run(f"listing {self.uri}", lambda: self._walk(patterns))
        if not found:
            raise nothing_matched(self.uri, patterns, self.retry.names)
        return sorted(found, key=lambda o: o.key)

    def _walk(self, include: tuple[str, ...]) -> list[ObjectIdentity]:
        root = self.uri.prefix
        try:
            if not stat.S_ISDIR(os.stat(root).st_mode):
                raise StoreStatus(404, "NotADirectory")
        except OSError as exc:
            raise _status_of(exc) from exc
        found = []

        def failed(exc: OSError) -> None:
            raise _status_of(exc) from exc

        for folder, _, names in os.walk(root, onerror=failed, followlinks=True):
            for name in names:
                path = os.path.join(folder, name)
                key = os.path.relpath(path, root)
                if not matches(key, include):
                    continue
                try:
                    info = os.stat(path)
                except OSError as exc:
                    raise _status_of(exc) from exc
                if stat.S_ISREG(info.st_mode):
                    found.append(ObjectIdentity(key, info.st_size, identity_of(info)))
        return found

    @contextlib.contextmanager
    def _body(self, obj: ObjectIdentity, start: int, length: int) -> Iterator[FileBody]:
        """The file opened and checked against the listing (see the module docstring)."""
        try:
            fd = os.open(self.uri.prefix + obj.key, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError as exc:
            raise source_changed(f"{self.uri}{obj.key}", "it is gone") from exc
        except OSError as exc:
            raise _status_of(exc) from exc
        try:
            now = identity_of(os.fstat(fd))
            if now != obj.etag:
                raise source_changed(f"{self.uri}{obj.key}",
                                     f"identity {now}, listed {obj.etag}")
            yield FileBody(fd, start, length)
        finally:
            os.close(fd)


def _status_of(exc: OSError) -> Exception:
    """A share's error as the seam speaks of it: transient I/O errors as a broken connection,
    a missing path or a denied one as the store's answer; an error of this node as it is."""
    if exc.errno in _TRANSIENT:
        return ConnectionError(f"{os.strerror(exc.errno)} (errno {exc.errno})")
    if exc.errno in (errno.ENOENT, errno.ENOTDIR):
        return StoreStatus(404, "NoSuchDirectory")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return StoreStatus(403, "PermissionDenied")
    return exc


class FileBody:
    """Bytes `[start, start + length)` of an open file, read into caller buffers (the seam's
    `Body`)."""

    def __init__(self, fd: int, start: int, length: int) -> None:
        self._fd, self._at, self._end = fd, start, start + length

    def fill(self, into: memoryview, algorithm: str, crc: int = 0) -> tuple[int, int]:
        return fill_hashed(self._readinto, into[:self._end - self._at], _PIECE_BYTES,
                           algorithm, crc)

    def _readinto(self, piece: memoryview) -> int:
        """0 where the file ends before the range (shorter than listed: a short body)."""
        try:
            count = os.preadv(self._fd, [piece], self._at)
        except OSError as exc:
            raise _status_of(exc) from exc
        self._at += count
        return count

    def finish(self) -> bool:
        return False  # a read never goes past the range asked for


def open_source(uri: SourceAddress, options: SourceOptions) -> FileSource:
    """The `file://` reader of `uri`."""
    return FileSource(uri, options)


__all__ = ["FileSource", "identity_of", "open_source"]
