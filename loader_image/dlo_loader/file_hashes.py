"""Whole-file hashes computed while a fill writes the files, not after its last byte.

Owns `FollowingHashes`: where the store's checksum of a file is a hash no chunk CRC combines into
(`digest.FILE_HASHES`: the Hub's LFS sha256, a listing file's sha256), a thread reads the file
back behind the point up to which every byte is written, while later bytes still arrive, so the
check before publication finds the hash done, or nearly (on a node with cores to spare the
transfer waits on the network, and hashing beside it costs no time; hashed after the transfer,
it took 0.18 s of a 0.41 s fill of 128 MiB from the loopback Hub stand-in on a 2-core host,
under `cProfile`). A file whose bytes were written twice (a range read again after a failed
peer) is hashed again afterwards, whole. Called by `transfer` for a fill reading alone; must
not decide what a mismatch means.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from dlo_loader.digest import file_hash, file_hasher

_THREADS = 4
_PIECE_BYTES = 8 << 20


class _Written:
    """One file's written spans: `frontier`, up to which every byte is written, and the spans
    beyond it; `twice` once a byte is written again."""

    def __init__(self, size: int) -> None:
        self.size, self.frontier, self.twice = size, 0, False
        self._beyond: dict[int, int] = {}  # start -> end of spans past the frontier

    def add(self, start: int, end: int) -> None:
        if start < self.frontier or start in self._beyond:
            self.twice = True
            return
        self._beyond[start] = end
        while self.frontier in self._beyond:
            self.frontier = self._beyond.pop(self.frontier)


class FollowingHashes:
    """The hashes of `wanted` (file index -> (path, algorithm)) of files of `sizes`, each read
    back behind its written frontier (see the module docstring); `written` is told of every
    span once it is on disk, `hash_of` waits for a file's hash, `close` stops the readers."""

    def __init__(self, wanted: dict[int, tuple[Path, str]], sizes: list[int]) -> None:
        self._wanted = wanted
        self._written = {index: _Written(sizes[index]) for index in wanted}
        self._cond = threading.Condition()
        self._closed = False
        self._finished = False
        """Set once the transfer ended: a file whose bytes were not all told written is hashed
        whole instead of waited for."""
        self._pool = ThreadPoolExecutor(max_workers=min(len(wanted), _THREADS) or 1,
                                        thread_name_prefix="dlo-follow-hash")
        self._hashes: dict[int, Future[str | None]] = {
            index: self._pool.submit(self._follow, index) for index in sorted(wanted)}

    def written(self, file: int, offset: int, length: int) -> None:
        if file in self._written:
            with self._cond:
                self._written[file].add(offset, offset + length)
                self._cond.notify_all()

    def hash_of(self, file: int, algorithm: str) -> str | None:
        """The `algorithm` of `file`, waiting for it (hashed again whole where following could
        not: a byte written twice); None where it was not followed for `algorithm`."""
        if self._wanted.get(file, (None, None))[1] != algorithm:
            return None
        with self._cond:  # asked after the transfer: nothing more will be written
            self._finished = True
            self._cond.notify_all()
        followed = self._hashes[file].result()
        return followed if followed is not None else file_hash(self._wanted[file][0], algorithm)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _follow(self, file: int) -> str | None:
        """The file's hash, read behind its frontier; None when it cannot be followed."""
        path, algorithm = self._wanted[file]
        written = self._written[file]
        hasher = file_hasher(algorithm, written.size)
        done = 0
        with open(path, "rb", buffering=0) as handle:
            while done < written.size:
                with self._cond:
                    self._cond.wait_for(lambda: self._closed or self._finished
                                        or written.twice or written.frontier > done)
                    if self._closed or written.twice or written.frontier <= done:
                        return None
                    until = written.frontier
                while done < until:
                    piece = os.pread(handle.fileno(), min(_PIECE_BYTES, until - done), done)
                    if not piece:
                        return None
                    hasher.update(piece)
                    done += len(piece)
        return hasher.hexdigest()
