"""Local files of a fill: the preallocated files being written, and an existing entry being read.

Owns file descriptors and positioned I/O. `FileSink` creates every file of the checkpoint in the
publication's tmp dir at its final size up front (so a full disk fails before any byte is
fetched) and writes chunks at their offsets from any thread. `EntryChunks` reads chunks of an
entry this node already holds, so a rank that has the checkpoint serves its share from disk.
Called by `fill` and `exchange`. Must not publish (that is `dlo_runtime.cache`), hash or talk to
peers.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from pathlib import Path

from dlo_loader.errors import LoaderError
from dlo_loader.plan import Chunk
from dlo_runtime.cache import ObjectIdentity, safe_relpath

_NO_FALLOCATE = frozenset({errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS})


class FileSink:
    """Every file of `files` created under `directory`, sized, and open for positioned writes."""

    def __init__(self, directory: Path, files: Sequence[ObjectIdentity]) -> None:
        self.paths = [directory / safe_relpath(obj.key) for obj in files]
        self._fds: list[int] = []
        try:
            for path, obj in zip(self.paths, files):
                path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
                self._fds.append(fd)
                _preallocate(fd, obj.size)
        except BaseException:
            self.close()
            raise

    def write(self, chunk: Chunk, data: memoryview) -> None:
        """Write `data` (exactly `chunk.length` bytes) at the chunk's offset."""
        fd, offset = self._fds[chunk.file], chunk.offset
        while data:
            written = os.pwrite(fd, data, offset)
            data, offset = data[written:], offset + written

    def close(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)


def _preallocate(fd: int, size: int) -> None:
    """Reserve the blocks now (ENOSPC here, not mid-fill); sparse size where unsupported."""
    if size == 0:
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in _NO_FALLOCATE:
            raise
        os.ftruncate(fd, size)


class EntryChunks:
    """Reads chunks of a published entry that holds the same files as the plan."""

    def __init__(self, entry_dir: Path, files: Sequence[ObjectIdentity]) -> None:
        self.entry_dir = entry_dir
        self.files = tuple(files)

    def read(self, chunk: Chunk, into: memoryview) -> None:
        path = self.entry_dir / safe_relpath(self.files[chunk.file].key)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            got = 0
            while got < len(into):
                count = os.preadv(fd, [into[got:]], chunk.offset + got)
                if not count:
                    break
                got += count
        finally:
            os.close(fd)
        if got != len(into):
            raise LoaderError(
                f"cached file {path} is shorter than its manifest says (read {got} of "
                f"{len(into)} bytes at offset {chunk.offset})",
                hint="verify the entry with dlo cache verify --full",
            )
