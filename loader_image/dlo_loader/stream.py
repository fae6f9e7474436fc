"""Reading alone: every chunk streams from the store to its place on disk, a piece at a time.

Owns the reader threads of an exchange without a group. Nothing waits for a chunk to be whole
(no peer is sent it), so a chunk needs no buffer of its own: each reader takes the next chunk
in plan order and has it streamed (a `Streamer`) through the one small buffer it keeps, writing
each piece at its place as soon as it lands, and the chunk's digest comes from the running CRC
of its pieces. Called by `exchange`. Must not talk to peers or decide what a failure means (it
keeps the first error for the caller).

[Note: streaming alone] With chunk buffers, `readers` whole chunks are in memory at once plus the
complete ones queued for the writers: with 16 readers and 16 MiB chunks, hundreds of MiB of fresh
memory the kernel clears page by page before the first byte lands (on the core the readers
share), and the last chunks were written only after the last bytes arrived. Streamed, the
memory is one `PIECE_BYTES` buffer per reader (32 MiB for 16), reused for every piece. The
reader writes each piece itself (direct I/O where the filesystem allows, see `sink`) before it
receives the next: while it writes, the kernel goes on receiving into the connection's socket
buffer, so the connection does not pause for a write that takes far less time than the buffer
holds. A writer thread beside each reader (two pieces in turn, the next received while the
last was written) cost more than it saved, the hand-offs between twice the threads: `dlo bench
loader` measured 0.90-1.04 CPU-seconds per GiB in the loader with it and 0.82-0.89 without
(three runs each, same host, same hour), and the fill was no slower. A retry asks only for the
bytes not delivered yet (`source.ObjectStore.stream`).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from dlo_loader import digest
from dlo_loader.fetch import Reader, chunk_buffer
from dlo_loader.plan import Chunk
from dlo_loader.progress import Progress
from dlo_loader.sink import FileSink
from dlo_contract.settings import STREAM_PIECE_BYTES

PIECE_BYTES = STREAM_PIECE_BYTES

Deliver = Callable[[int, memoryview], None]
"""`deliver(at, view)`: the bytes of `view` are the chunk's bytes from offset `at` on. When it
returns, the piece's buffer may be read into again."""
Streamer = Callable[[int, int, int, Iterator[memoryview], Deliver], int]
"""`stream(file, offset, length, pieces, deliver)` reads bytes `[offset, offset + length)` of the
plan's file `file` a piece at a time, each into the next of `pieces` (buffers of one size,
endlessly; the same one again, as `deliver` is done with a piece when it returns) cut to the
bytes still to come, handing each piece to `deliver` in order, and returns the running CRC of
them all (`digest.extend`), or raises."""


def streamer_of(read: Reader, algorithms: Sequence[str]) -> Streamer:
    """A `Streamer` over a `Reader` (an entry on disk, a test's reader): one read per piece,
    each piece's CRC of its file's digest (`algorithms`, by file)."""
    def stream(file: int, offset: int, length: int, pieces: Iterator[memoryview],
               deliver: Deliver) -> int:
        value = at = 0
        while at < length:
            view = next(pieces)[:length - at]
            value = digest.combine(value, read(file, offset + at, view), len(view),
                                   algorithms[file])
            deliver(at, view)
            at += len(view)
        return value

    return stream


class ChunkStreams:
    """Streams `chunks` into `sink` on up to `readers` daemon threads, in plan order."""

    def __init__(self, chunks: tuple[Chunk, ...], stream: Streamer, sink: FileSink, *,
                 algorithms: Sequence[str], readers: int, stop: threading.Event,
                 progress: Progress) -> None:
        self.digests: dict[int, str] = {}
        """Each streamed chunk's digest, by chunk index."""
        self.error: BaseException | None = None
        self._chunks, self._stream, self._sink = chunks, stream, sink
        self._algorithms = algorithms
        self._stop, self._progress = stop, progress
        self._next = 0
        self._cond = threading.Condition()
        self._running = min(readers, len(chunks))
        for number in range(self._running):
            threading.Thread(target=self._work, name=f"dlo-stream-{number}", daemon=True).start()

    def wait(self, timeout: float) -> bool:
        """True when every chunk is streamed or one failed (the caller checks `error`)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._running or self.error is not None,
                                       timeout)

    def _work(self) -> None:
        buffer = memoryview(chunk_buffer(PIECE_BYTES))  # unmapped with its last view
        pieces = itertools.repeat(buffer)  # each piece is on disk before the next is read
        try:
            while (chunk := self._claim()) is not None:
                self._one(chunk, pieces)
        except BaseException as exc:  # handed to the consumer, which reports it
            with self._cond:
                self.error = self.error or exc
        finally:
            with self._cond:
                self._running -= 1
                self._cond.notify_all()

    def _claim(self) -> Chunk | None:
        with self._cond:
            if self._stop.is_set() or self.error is not None or self._next >= len(self._chunks):
                return None
            self._next += 1
            return self._chunks[self._next - 1]

    def _one(self, chunk: Chunk, pieces: Iterator[memoryview]) -> None:
        writing = 0.0
        reached = 0  # a chunk delivered again (a peer's bad one, from the store) counts once

        def deliver(at: int, view: memoryview) -> None:
            nonlocal writing, reached
            began = time.monotonic()
            self._sink.write_at(chunk.file, chunk.offset + at, view)
            writing += time.monotonic() - began
            self._progress.add(written=max(at + len(view) - reached, 0))
            reached = max(reached, at + len(view))

        began = time.monotonic()
        value = self._stream(chunk.file, chunk.offset, chunk.length, pieces, deliver)
        self._progress.timed("get", time.monotonic() - began - writing)
        self._progress.timed("write", writing)
        with self._cond:
            self.digests[chunk.index] = digest.of_running(value, self._algorithms[chunk.file])
