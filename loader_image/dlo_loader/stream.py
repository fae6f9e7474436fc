"""Reading alone: every chunk streams from the store to its place on disk, a piece at a time.

Owns the reader threads of an exchange without a group, and a writer beside each. Nothing
waits for a chunk to be whole (no peer is sent it), so a chunk needs no buffer of its own: each
reader takes the next chunk in plan order and has it streamed (a `Streamer`) through the two
small buffers it keeps, each piece handed to its writer as soon as it lands, and the chunk's
digest comes from the running CRC of its pieces. Called by `exchange`. Must not talk to peers
or decide what a failure means (it keeps the first error for the caller).

[Note: streaming alone] With chunk buffers, `readers` whole chunks are in memory at once plus the
complete ones queued for the writers: with 16 readers and 16 MiB chunks, hundreds of MiB of fresh
memory the kernel clears page by page before the first byte lands (on the core the readers
share), and the last chunks were written only after the last bytes arrived. Streamed, the
memory is two `PIECE_BYTES` buffers per reader (64 MiB for 16), reused for every piece: while
the writer puts one piece on disk the reader receives the next into the other, instead of
receiving nothing while it writes. A retry asks only for the bytes not delivered yet
(`source.ObjectStore.stream`).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future

from dlo_loader import digest
from dlo_loader.fetch import Reader, chunk_buffer
from dlo_loader.plan import Chunk
from dlo_loader.progress import Progress
from dlo_loader.sink import FileSink
from dlo_contract.settings import STREAM_PIECE_BYTES

PIECE_BYTES = STREAM_PIECE_BYTES

Deliver = Callable[[int, memoryview], None]
"""`deliver(at, view)`: the bytes of `view` are the chunk's bytes from offset `at` on. When it
returns, the buffer of the piece delivered before this one may be read into again."""
Streamer = Callable[[int, int, int, Iterator[memoryview], Deliver], int]
"""`stream(file, offset, length, pieces, deliver)` reads bytes `[offset, offset + length)` of the
plan's file `file` a piece at a time, each into the next of `pieces` (equal buffers, endlessly
in turn) cut to the bytes still to come, handing each piece to `deliver` in order, and returns
the running CRC of them all (`digest.extend`), or raises."""


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
            threading.Thread(target=self._work, args=(number,), name=f"dlo-stream-{number}",
                             daemon=True).start()

    def wait(self, timeout: float) -> bool:
        """True when every chunk is streamed or one failed (the caller checks `error`)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._running or self.error is not None,
                                       timeout)

    def _work(self, number: int) -> None:
        buffer = memoryview(chunk_buffer(2 * PIECE_BYTES))  # unmapped with its last view
        pieces = itertools.cycle((buffer[:PIECE_BYTES], buffer[PIECE_BYTES:]))
        writer = _Writer(f"dlo-write-{number}")
        try:
            while (chunk := self._claim()) is not None:
                self._one(chunk, pieces, writer)
        except BaseException as exc:  # handed to the consumer, which reports it
            with self._cond:
                self.error = self.error or exc
        finally:
            writer.close()
            with self._cond:
                self._running -= 1
                self._cond.notify_all()

    def _claim(self) -> Chunk | None:
        with self._cond:
            if self._stop.is_set() or self.error is not None or self._next >= len(self._chunks):
                return None
            self._next += 1
            return self._chunks[self._next - 1]

    def _one(self, chunk: Chunk, pieces: Iterator[memoryview], writer: _Writer) -> None:
        writing = [0.0]  # added to on the writer's thread, read once its last write is waited for
        waiting = [0.0]
        previous: list[Future[None]] = []  # the piece being written, at most one

        def write(at: int, view: memoryview) -> None:
            began = time.monotonic()
            self._sink.write_at(chunk.file, chunk.offset + at, view)
            writing[0] += time.monotonic() - began
            self._progress.add(written=len(view))

        def settle() -> None:
            if previous:
                began = time.monotonic()
                previous.pop().result()  # raises the write's error in this reader
                waiting[0] += time.monotonic() - began

        def deliver(at: int, view: memoryview) -> None:
            settle()  # the previous piece is on disk: its buffer is the next one read into
            previous.append(writer.submit(lambda: write(at, view)))

        began = time.monotonic()
        value = self._stream(chunk.file, chunk.offset, chunk.length, pieces, deliver)
        settle()  # (after a failure the write in flight ends alone; the error is the read's)
        self._progress.timed("get", time.monotonic() - began - waiting[0])
        self._progress.timed("write", writing[0])
        with self._cond:
            self.digests[chunk.index] = digest.of_running(value, self._algorithms[chunk.file])


class _Writer:
    """A daemon thread that runs one reader's writes in order, beside its reads."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], None], Future[None]] | None] = (
            queue.SimpleQueue())
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, call: Callable[[], None]) -> Future[None]:
        """`call` queued; its future says when it ran, and raises what it raised."""
        future: Future[None] = Future()
        self._jobs.put((call, future))
        return future

    def close(self) -> None:
        """The thread ends once the writes queued before are done."""
        self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            call, future = job
            try:
                call()
            except BaseException as exc:  # raised again in the reader that waits for it
                future.set_exception(exc)
            else:
                future.set_result(None)
