"""The order in which one rank fetches its chunks: pure bookkeeping, no threads, no I/O.

Owns two decisions. `fetch_shape` sizes the fetch: how many ranged GETs make up one chunk
(parts) and how many chunks may be in flight at once (open chunks). `FetchOrder` hands out parts
in the order the exchange consumes the chunks, opening a new chunk only while fewer than the
limit are open. Called by `fetch` (which runs the reader threads). Must not sleep, read or lock.

[Note: ordered fetching] With a group, round `k` of the exchange waits for the `k`-th chunk of
every rank. GETs that share one link and start together also finish together, so a rank that
starts `readers` whole chunks at once has its first chunk ready only when nearly all of them
are: the exchange idles, then runs after the reads instead of beside them. With a group, a rank
therefore keeps only a few chunks open and splits each into parts, so that `readers` GETs still
run (throughput on a fast link) while chunk `k` completes before chunk `k + open` (the first
round is ready after a few chunks' worth of bytes whatever `readers` is). Parts are never smaller
than `MIN_PART_BYTES` and a chunk has at most `MAX_PARTS`: every GET costs a request's latency and
the client's CPU, so small chunks run fewer GETs than `readers` (at most `MAX_OPEN_CHUNKS` chunks
of `MAX_PARTS` parts). Open chunks, and complete ones waiting for their round, each hold one of
the buffers the memory budget leaves for fetching (see [Note: memory bound] in `exchange_budget`): that
bounds the read-ahead. Alone (no group), nothing waits on the order and no chunk is held whole:
chunks stream to disk (see [Note: streaming alone] in `stream`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

MIN_PART_BYTES = 1 << 20
"""Smallest ranged GET a chunk is split into: a 2 MiB chunk on a slow link still arrives in two
halves at once, so the first round waits for one chunk's bytes, not two chunks'."""
MAX_PARTS = 4
"""Most ranged GETs per chunk (the S3 guidance for ranged reads is 8-16 MB; a 16 MiB chunk in four
parts keeps the extra requests to three per chunk)."""
MAX_OPEN_CHUNKS = 4
"""With a group: chunks in flight at once, whatever `readers` is (see [Note: ordered fetching])."""


@dataclass(frozen=True, kw_only=True)
class FetchShape:
    part_bytes: int
    """Bytes per ranged GET (a chunk's last part may be shorter)."""
    open_chunks: int
    """Chunks in flight at once."""
    readers: int
    """Reader threads: enough to keep every part of every open chunk in flight."""


def fetch_shape(*, chunk_bytes: int, readers: int, buffers: int) -> FetchShape:
    """The shape of one rank's fetch for a group, which consumes the chunks in order; `buffers`
    is how many chunks its memory budget holds for fetching (at least one)."""
    parts = max(1, min(readers, chunk_bytes // MIN_PART_BYTES, MAX_PARTS))
    # At least two open chunks, so the next one streams while the last part of this one trails.
    open_chunks = max(1, min(max(2, math.ceil(readers / parts)), MAX_OPEN_CHUNKS, buffers))
    part_bytes = math.ceil(chunk_bytes / parts)
    return FetchShape(part_bytes=part_bytes, open_chunks=open_chunks,
                      readers=max(1, min(readers, open_chunks * parts)))


@dataclass(frozen=True)
class Part:
    """Bytes `[start, start + length)` of the chunk at `position` in the rank's fetch order."""

    position: int
    start: int
    length: int

    @property
    def opens(self) -> bool:
        """The first part of its chunk: claiming it opens the chunk."""
        return self.start == 0


class FetchOrder:
    """Parts of the chunks of `lengths`, handed out chunk after chunk, part after part, with at
    most `open_limit` chunks claimed but not complete."""

    def __init__(self, lengths: Sequence[int], *, part_bytes: int, open_limit: int) -> None:
        if part_bytes < 1 or open_limit < 1:
            raise ValueError(f"part_bytes={part_bytes} and open_limit={open_limit} must be >= 1")
        self._lengths = tuple(lengths)
        self._part_bytes = part_bytes
        self._open_limit = open_limit
        self._position = 0
        self._start = 0
        self._pending: dict[int, int] = {}  # open chunk -> parts not yet complete

    @property
    def all_claimed(self) -> bool:
        return self._position >= len(self._lengths)

    def claim(self, *, can_open: bool = True) -> Part | None:
        """The next part to fetch, or None: every part is claimed, or the next part would open a
        chunk while `open_limit` are open or the caller cannot open one (`can_open`: no free
        buffer)."""
        if self.all_claimed:
            return None
        length = self._lengths[self._position]
        if self._start == 0:
            if len(self._pending) >= self._open_limit or not can_open:
                return None
            self._pending[self._position] = math.ceil(length / self._part_bytes)
        part = Part(self._position, self._start, min(self._part_bytes, length - self._start))
        self._start += part.length
        if self._start >= length:
            self._position, self._start = self._position + 1, 0
        return part

    def complete(self, part: Part) -> bool:
        """Record `part` as fetched; True when it was the last outstanding part of its chunk
        (the chunk is complete and no longer open)."""
        left = self._pending[part.position] - 1
        if left:
            self._pending[part.position] = left
            return False
        del self._pending[part.position]
        return True
