"""The writers of one exchange: every chunk hashed (unless its digest came with it) and written
at its offset, on a few threads beside the exchange's main thread.

Owns `ChunkWriter`: a queue of chunks, the threads that drain it and the digest of every chunk
by index. Called by `exchange`, which hands it each chunk with the callable that releases its
buffer; it reads nothing and knows no group.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable

from dlo_loader.digest import chunk_digest
from dlo_loader.plan import Chunk, Plan
from dlo_loader.progress import Progress
from dlo_loader.sink import FileSink

WRITER_THREADS = max(2, min(4, os.cpu_count() or 1))
"""Hashing (the digest releases the GIL) and positioned writes of several chunks at once."""

WriteTask = tuple[Chunk, memoryview, Callable[[], None], str | None]


class ChunkWriter:
    """Writes chunks (hashing those that arrive without a digest) on a few daemon threads;
    records one digest per chunk."""

    def __init__(self, plan: Plan, sink: FileSink | None, progress: Progress) -> None:
        self.digests: list[str | None] = [None] * len(plan.chunks)
        self.written: dict[int, str] = {}
        """The chunks on disk, written whole, and their digests, by chunk index."""
        self.error: BaseException | None = None
        self.sink, self._progress = sink, progress
        self._algorithms = plan.algorithms
        self._queue: queue.Queue[WriteTask | None] = queue.Queue()
        self._closed = False
        for number in range(WRITER_THREADS):
            threading.Thread(target=self._work, name=f"dlo-write-{number}", daemon=True).start()

    def close(self) -> None:
        """End the threads once the queued writes are done. A thread waiting for work holds its
        last task's buffer and pool, which would keep every chunk buffer of the fill alive in a
        loader that stays up after it (the pod's sidecar)."""
        if self._closed:
            return
        self._closed = True
        for _ in range(WRITER_THREADS):
            self._queue.put(None)

    def submit(self, chunk: Chunk, view: memoryview, release: Callable[[], None],
               digest: str | None = None) -> None:
        """Write the chunk's bytes `view` (hash them unless `digest` is given), then call
        `release` (its buffer may be reused)."""
        self._queue.put((chunk, view, release, digest))

    def write_here(self, chunk: Chunk, view: memoryview, digest: str) -> None:
        """Write a chunk whose digest is known on the caller's thread (the writers may be
        done), and record it like theirs."""
        self.digests[chunk.index] = digest
        if self.sink is not None:
            self.sink.write(chunk, view)
            self.written[chunk.index] = digest

    def drain(self) -> None:
        self._queue.join()

    def _work(self) -> None:
        while (task := self._queue.get()) is not None:
            chunk, view, release, digest = task
            try:
                if self.error is None:
                    if digest is None:
                        began = time.monotonic()
                        digest = chunk_digest(view, self._algorithms[chunk.file])
                        self._progress.timed("digest", time.monotonic() - began)
                    self.digests[chunk.index] = digest
                    if self.sink is not None:
                        began = time.monotonic()
                        self.sink.write(chunk, view)
                        self._progress.timed("write", time.monotonic() - began)
                        self.written[chunk.index] = digest
                    self._progress.add(written=chunk.length)
            except BaseException as exc:  # reported by the main thread at the next round
                self.error = self.error or exc
            finally:
                release()
                self._queue.task_done()
        self._queue.task_done()
