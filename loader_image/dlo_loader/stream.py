"""Reading alone: every chunk streams from the store to its place on disk, a piece at a time.

Owns the reader threads of an exchange without a group. Nothing waits for a chunk to be whole
(no peer is sent it), so a chunk needs no buffer of its own: each thread takes the next chunk in
plan order and has it streamed (a `Streamer`) through one small buffer it keeps, each piece
written at its offset by the sink as soon as it lands, and the chunk's digest comes from the
running CRC of its pieces. Called by `exchange`. Must not talk to peers or decide what a failure
means (it keeps the first error for the caller).

[Note: streaming alone] With chunk buffers, `readers` whole chunks are in memory at once plus the
complete ones queued for the writers: with 16 readers and 16 MiB chunks, hundreds of MiB of fresh
memory the kernel clears page by page before the first byte lands (on the core the readers
share), and the last chunks were written only after the last bytes arrived. Streamed, the
memory is one `PIECE_BYTES` buffer per reader (32 MiB for 16), reused for every piece, and the
writes run beside the reads up to the last piece. A retry asks only for the bytes not delivered
yet (`source.ObjectStore.stream`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from dlo_loader import digest
from dlo_loader.fetch import Reader, chunk_buffer
from dlo_loader.plan import Chunk
from dlo_loader.progress import Progress
from dlo_loader.sink import FileSink
from dlo_contract.settings import STREAM_PIECE_BYTES

PIECE_BYTES = STREAM_PIECE_BYTES

Deliver = Callable[[int, memoryview], None]
"""`deliver(at, view)`: the bytes of `view` are the chunk's bytes from offset `at` on."""
Streamer = Callable[[int, int, int, memoryview, Deliver], int]
"""`stream(file, offset, length, piece, deliver)` reads bytes `[offset, offset + length)` of the
plan's file `file` through the buffer `piece`, handing each piece to `deliver` in order (every
one `len(piece)` bytes but the last), and returns the running CRC of them all (`digest.extend`),
or raises."""


def streamer_of(read: Reader) -> Streamer:
    """A `Streamer` over a `Reader`: one read per piece (an entry on disk, a test's reader)."""
    def stream(file: int, offset: int, length: int, piece: memoryview,
               deliver: Deliver) -> int:
        value = at = 0
        while at < length:
            view = piece[:min(len(piece), length - at)]
            value = digest.combine(value, read(file, offset + at, view), len(view))
            deliver(at, view)
            at += len(view)
        return value

    return stream


class ChunkStreams:
    """Streams `chunks` into `sink` on up to `readers` daemon threads, in plan order."""

    def __init__(self, chunks: tuple[Chunk, ...], stream: Streamer, sink: FileSink, *,
                 readers: int, stop: threading.Event, progress: Progress) -> None:
        self.digests: dict[int, str] = {}
        """Each streamed chunk's digest, by chunk index."""
        self.error: BaseException | None = None
        self._chunks, self._stream, self._sink = chunks, stream, sink
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
        piece = memoryview(chunk_buffer(PIECE_BYTES))  # unmapped with the thread's last view
        try:
            while (chunk := self._claim()) is not None:
                self._one(chunk, piece)
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

    def _one(self, chunk: Chunk, piece: memoryview) -> None:
        writing = [0.0]

        def deliver(at: int, view: memoryview) -> None:
            began = time.monotonic()
            self._sink.write_at(chunk.file, chunk.offset + at, view)
            writing[0] += time.monotonic() - began
            self._progress.add(written=len(view))

        began = time.monotonic()
        value = self._stream(chunk.file, chunk.offset, chunk.length, piece, deliver)
        self._progress.timed("get", time.monotonic() - began - writing[0])
        self._progress.timed("write", writing[0])
        with self._cond:
            self.digests[chunk.index] = digest.of_parts([(chunk.length, value)])
