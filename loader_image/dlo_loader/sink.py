"""Local files of a fill: the preallocated files being written, and an existing entry being read.

Owns file descriptors and positioned I/O. `FileSink` creates every file of the checkpoint in the
publication's tmp dir at its final size up front (so a full disk fails before any byte is
fetched) and writes chunks at their offsets from any thread. A descriptor is open only for one
write (a checkpoint of thousands of files must not need one per file for the whole fill under a
1024 open-file limit). `EntryChunks` reads byte ranges of
an entry this node already holds, so a rank that has the checkpoint serves its share from disk.
Called by `fill` and `exchange`. Must not publish (that is `dlo_contract.cache`) or talk to
peers; it hashes only what it reads (see [Note: hashing while reading] in `digest`).

[Note: direct writes] Chunks are written with `O_DIRECT` where the filesystem allows it: the
device reads them straight from the (page-aligned) chunk buffer, so the CPU neither copies every
byte into the page cache nor later waits for all of them at the commit's fsync; the writes
overlap the fetch instead. Only aligned spans go that way (the last chunk of a file usually ends
off the alignment: its tail is written through the page cache, a disjoint page). A filesystem
that refuses `O_DIRECT` (at open, or with `EINVAL` at the first write) gets ordinary writes. The
commit's fsync still makes every byte durable either way.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from dlo_loader import digest
from dlo_loader.errors import LoaderError
from dlo_loader.plan import Chunk
from dlo_contract.cache import ObjectIdentity, safe_relpath

log = logging.getLogger(__name__)

ALIGN = 4096
"""Alignment of direct writes: offset, length and buffer address (page size; at least the
logical block size of common devices)."""
_NO_FALLOCATE = frozenset({errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS})
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_READ_PIECE_BYTES = 1 << 20
"""Bytes read from a cached entry per call, hashed while they are in the CPU's cache."""


class FileSink:
    """Every file of `files` created under `directory`, sized, then written chunk by chunk."""

    def __init__(self, directory: Path, files: Sequence[ObjectIdentity]) -> None:
        self.paths = [directory / safe_relpath(obj.key) for obj in files]
        self._direct = [bool(_O_DIRECT) and obj.size >= ALIGN for obj in files]
        """Per file: direct writes still allowed (until the filesystem refuses them)."""
        for path, obj in zip(self.paths, files):
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                _preallocate(fd, obj.size)
            finally:
                os.close(fd)

    def write(self, chunk: Chunk, data: memoryview) -> None:
        """Write `data` (exactly `chunk.length` bytes) at the chunk's offset."""
        self.write_at(chunk.file, chunk.offset, data)

    def write_at(self, file: int, offset: int, data: memoryview) -> None:
        """Write `data` at `offset` of the plan's file `file` (from any thread)."""
        aligned = len(data) - len(data) % ALIGN if offset % ALIGN == 0 else 0
        if self._direct[file] and aligned:
            try:
                _write_at(self.paths[file], data[:aligned], offset, direct=True)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._refuse_direct(file, exc)  # then written below, through the cache
                aligned = 0
        else:
            aligned = 0
        if aligned < len(data):
            _write_at(self.paths[file], data[aligned:], offset + aligned, direct=False)

    def _refuse_direct(self, file: int, exc: OSError) -> None:
        if self._direct[file]:
            self._direct[file] = False
            log.info("%s: direct writes refused (%s); writing through the page cache",
                     self.paths[file], exc.strerror)


def _write_at(path: Path, data: memoryview, offset: int, *, direct: bool) -> None:
    """One positioned write on a descriptor opened for it (`O_DIRECT` when `direct`)."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | (_O_DIRECT if direct else 0))
    try:
        _pwrite_all(fd, data, offset)
    finally:
        os.close(fd)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


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
    """Reads byte ranges of a published entry that holds the same files as the plan."""

    def __init__(self, entry_dir: Path, files: Sequence[ObjectIdentity],
                 algorithms: Sequence[str]) -> None:
        self.entry_dir = entry_dir
        self.files = tuple(files)
        self.algorithms = tuple(algorithms)
        """Per file: the digest of its chunks in the plan (`digest.extend`)."""

    def read(self, file: int, offset: int, into: memoryview) -> int:
        """Fill `into` with bytes `[offset, offset + len(into))` of the plan's file `file`;
        returns their running CRC (`digest.extend`), a piece at a time while it is cached."""
        path = self.entry_dir / safe_relpath(self.files[file].key)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            got = crc = 0
            while got < len(into):
                count = os.preadv(fd, [into[got:got + _READ_PIECE_BYTES]], offset + got)
                if not count:
                    break
                crc = digest.extend(crc, into[got:got + count], self.algorithms[file])
                got += count
        finally:
            os.close(fd)
        if got != len(into):
            raise LoaderError(
                f"cached file {path} is shorter than its manifest says (read {got} of "
                f"{len(into)} bytes at offset {offset})",
                hint="verify the entry with dlo cache verify --full",
            )
        return crc
