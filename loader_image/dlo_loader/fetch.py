"""Fetching one rank's chunks: reader threads, the chunk buffers, and the digest of each chunk.

Owns the threads that read (through a `Reader`, so the object store and a cached entry look the
same), the pool of chunk buffers, and each chunk's digest, combined from the running CRCs the
reads return (see [Note: hashing while reading] in `digest`). Which part a free
reader fetches next is `schedule.FetchOrder`'s decision. Called by `exchange`. Must not write
files, talk to peers, or decide what a failure means (it hands the error to the caller).

[Note: chunk buffers] A buffer is a private anonymous page-aligned mapping of `chunk_bytes`,
made on first need and reused after the chunk is written, so a fill touches fresh memory only for
the buffers it holds at once, not for every chunk; the alignment lets the sink write it with
direct I/O. Private, not `mmap`'s default shared mapping: a shared anonymous page is a shmem page
(page-cache bookkeeping on every first touch) and never a transparent huge page, while a
private one is asked for huge pages (`MADV_HUGEPAGE`), so filling a buffer costs a handful of page
faults instead of one per 4 KiB (a fill's buffers are a few hundred MiB). A chunk opens (its
first part is claimed) only with a free buffer, so at most `limit`
chunks are in flight or waiting to be consumed: the memory bound.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from dlo_loader import digest
from dlo_loader.plan import Chunk
from dlo_loader.schedule import FetchOrder, FetchShape, Part

if TYPE_CHECKING:
    from dlo_loader.exchange_budget import BufferAccount

Reader = Callable[[int, int, memoryview], int]
"""`read(file, offset, into)` fills `into` with bytes `[offset, offset + len(into))` of the plan's
file `file`, exactly, and returns their running CRC (`digest.extend`, see [Note: hashing while
reading]), or raises."""
POLL_S = 0.2
"""Longest a waiting thread sleeps before it looks at the stop flag again."""


def chunk_buffer(size: int) -> mmap.mmap:
    """A private anonymous page-aligned buffer of `size` bytes (see [Note: chunk buffers])."""
    buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):  # huge pages are a hint, not a need
        buffer.madvise(mmap.MADV_HUGEPAGE)
    return buffer


Span = tuple[int, int, int]
"""A chunk's bytes, `(file, offset, length)`: the same in every plan of one listing and chunk
size, whoever owns the chunk."""


def span_of(chunk: Chunk) -> Span:
    return chunk.file, chunk.offset, chunk.length


class BufferPool:
    """At most `limit` page-aligned buffers of `size` bytes (see [Note: chunk buffers]), each
    counted in `account` while it lives."""

    def __init__(self, limit: int, size: int, account: BufferAccount | None = None) -> None:
        self.limit, self.size = limit, size
        self._account = account
        self._free: list[mmap.mmap] = []
        self._made = 0
        self._released = False
        self._cond = threading.Condition()

    def release(self) -> None:
        """Free the idle buffers, and each one given back from now on: the pool is done."""
        with self._cond:
            self._released, self.limit = True, 0
            self._free.clear()

    def available(self) -> bool:
        with self._cond:
            return bool(self._free) or self._made < self.limit

    def take(self) -> mmap.mmap | None:
        """A buffer at once, or None when all `limit` are in use."""
        with self._cond:
            if self._free:
                return self._free.pop()
            if self._made < self.limit:
                self._made += 1
                buffer = chunk_buffer(self.size)
                if self._account is not None:
                    self._account.charge(buffer, self.size)
                return buffer
            return None

    def wait(self, timeout: float) -> mmap.mmap | None:
        """A buffer, waiting up to `timeout` seconds for one to come back."""
        with self._cond:
            self._cond.wait_for(lambda: self._free or self._made < self.limit, timeout)
        return self.take()

    def give_back(self, buffer: mmap.mmap) -> None:
        with self._cond:
            if not self._released:
                self._free.append(buffer)
            self._cond.notify_all()


class Fetcher:
    """Reads `chunks` on daemon threads in the shape `shape`; `take` hands out complete chunks
    with their digest (in order with `position`, else whichever is ready)."""

    def __init__(self, chunks: tuple[Chunk, ...], read: Reader, *, shape: FetchShape,
                 pool: BufferPool, stop: threading.Event, algorithms: Sequence[str],
                 timed: Callable[[str, float], None] = lambda stage, seconds: None) -> None:
        self._chunks, self._read, self._pool, self._stop = chunks, read, pool, stop
        self._timed, self._algorithms = timed, algorithms
        self._order = FetchOrder([c.length for c in chunks], part_bytes=shape.part_bytes,
                                 open_limit=shape.open_chunks)
        self._cond = threading.Condition()
        self._open: dict[int, mmap.mmap] = {}
        self._parts: dict[int, dict[int, tuple[int, int]]] = {}
        """Per open chunk: each fetched part's `(length, running CRC)` by its start."""
        self._ready: dict[int, tuple[mmap.mmap, str]] = {}
        self._opening = True
        """False once `open_no_more`: the readers finish the open chunks only."""
        self.error: BaseException | None = None
        for number in range(min(shape.readers, len(chunks))):
            threading.Thread(target=self._work, name=f"dlo-read-{number}", daemon=True).start()

    def take_all_ready(self) -> dict[Span, tuple[mmap.mmap, str]]:
        """Every complete chunk not taken yet, by its span, with its buffer and digest."""
        with self._cond:
            ready, self._ready = self._ready, {}
            return {span_of(self._chunks[position]): found for position, found in ready.items()}

    def open_no_more(self) -> None:
        """Open no further chunk: the readers finish the parts of the open ones, then idle."""
        with self._cond:
            self._opening = False
            self._cond.notify_all()

    def wait_open(self, timeout: float) -> bool:
        """True once no chunk is open (each complete, or its reads stopped), or a read
        failed."""
        with self._cond:
            return self._cond.wait_for(
                lambda: not self._open or self.error is not None or self._stop.is_set(), timeout)

    def give_back(self, buffer: mmap.mmap) -> None:
        """Return a consumed chunk's buffer; a reader may open the next chunk with it."""
        self._pool.give_back(buffer)
        with self._cond:
            self._cond.notify_all()

    def wait_ready(self, timeout: float, position: int | None = None) -> bool:
        """True when chunk `position` (None: any chunk) is complete, or a read failed (the
        caller checks `error`)."""
        def ready() -> bool:
            found = bool(self._ready) if position is None else position in self._ready
            return found or self.error is not None

        with self._cond:
            return self._cond.wait_for(ready, timeout)

    def take(self, position: int | None = None) -> tuple[Chunk, mmap.mmap, str]:
        """A complete chunk (`position`, else the lowest ready one), its buffer and digest."""
        with self._cond:
            key = min(self._ready) if position is None else position
            buffer, found = self._ready.pop(key)
            return self._chunks[key], buffer, found

    def _work(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                part = self._claim()
                if part is None:
                    if self._order.all_claimed:
                        return
                    self._cond.wait(POLL_S)  # woken when a chunk completes or a buffer is free
                    continue
                buffer = self._open[part.position]
            chunk = self._chunks[part.position]
            view = memoryview(buffer)[part.start:part.start + part.length]
            try:
                began = time.monotonic()
                crc = self._read(chunk.file, chunk.offset + part.start, view)
                self._timed("get", time.monotonic() - began)
                self._fetched(part, buffer, crc)
            except BaseException as exc:  # handed to the consumer, which reports it
                with self._cond:
                    self.error = self.error or exc
                    self._cond.notify_all()
                return

    def _fetched(self, part: Part, buffer: mmap.mmap, crc: int) -> None:
        """Record a fetched part; the chunk's last one makes it ready, with its digest."""
        with self._cond:
            parts = self._parts.setdefault(part.position, {})
            parts[part.start] = (part.length, crc)
            if self._order.complete(part):
                del self._open[part.position], self._parts[part.position]
                chunk_digest = digest.of_parts([parts[start] for start in sorted(parts)],
                                               self._algorithms[self._chunks[part.position].file])
                self._ready[part.position] = (buffer, chunk_digest)
            self._cond.notify_all()  # a chunk is ready, or a slot for a new one is free

    def _claim(self) -> Part | None:
        """The next part (caller holds `_cond`); opening a chunk takes a buffer for it."""
        part = self._order.claim(can_open=self._opening and self._pool.available())
        if part is not None and part.opens:
            buffer = self._pool.take()
            assert buffer is not None  # only this thread, under _cond, takes fetch buffers
            self._open[part.position] = buffer
        return part
