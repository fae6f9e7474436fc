"""The data path of one fill: fetch this rank's chunks, exchange them with the group, write and
hash every chunk, within a fixed memory budget.

Owns the pipeline and its bounds. A pool of reader threads fetches this rank's chunks in plan order
(many ranged GETs at once) and hashes each; a few writer threads write every chunk at its offset
(hashing the ones received from peers). With a group, the main thread walks the plan's rounds: a
status exchange (who failed, who is ready), then one broadcast per chunk of the round. Called by `fill`. Must not decide policy (modes,
fallback, publication) or touch the object store directly (it gets a `read` callable).

[Note: memory bound] `memory_limit_bytes // chunk_bytes` buffers exist at most: with a group, one
or two receive buffers (double buffering: the next chunk arrives while the last one is written)
and the rest for fetched chunks, in a pool that a reader takes a buffer from before it claims a
chunk and the writer returns it to once the chunk is on disk (and broadcast). Readers claim chunks
in plan order, so the chunk the main thread waits for always holds a buffer or is done: no
deadlock.

[Note: failing together] Every failure (a read that gave up, a write error, the deadline) is
reported in the next round's status exchange, so all ranks raise in the same round. A rank that
dies instead closes its sockets, which fails the others' next collective at once.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from dlo_loader.errors import GroupError, LoaderError
from dlo_loader.plan import Chunk, Plan
from dlo_loader.progress import Progress
from dlo_loader.sink import FileSink
from dlo_runtime.settings import LoaderConfig

if TYPE_CHECKING:  # transport imports torch: only fills with a group load it
    from dlo_loader.transport import Group

Reader = Callable[[Chunk, memoryview], None]
"""Fills the given buffer (exactly `chunk.length` bytes) with the chunk's bytes, or raises."""
_POLL_S = 0.2
_WRITER_THREADS = max(2, min(4, os.cpu_count() or 1))
"""Hashing (hashlib releases the GIL) and positioned writes of several chunks at once."""


class _Buffers:
    """At most `count` chunk buffers, made on first use and then reused, so a fill does not
    zero and fault in fresh pages for every chunk. `get` waits while all are in use."""

    def __init__(self, count: int, size: int) -> None:
        self._free: queue.Queue[bytearray] = queue.Queue()
        self._left, self._size = count, size
        self._lock = threading.Lock()

    def get(self, timeout: float) -> bytearray | None:
        with self._lock:
            if self._free.empty() and self._left:
                self._left -= 1
                return bytearray(self._size)
        try:
            return self._free.get(timeout=timeout)
        except queue.Empty:
            return None

    def put(self, buffer: bytearray) -> None:
        self._free.put(buffer)


class _Fetcher:
    """Reads `chunks` on daemon threads, handing them out in order (see [Note: memory bound])."""

    def __init__(self, chunks: tuple[Chunk, ...], read: Reader, *, concurrency: int,
                 buffers: _Buffers, stop: threading.Event) -> None:
        self._chunks, self._read, self._buffers, self._stop = chunks, read, buffers, stop
        self._cond = threading.Condition()
        self._results: dict[int, tuple[bytearray, str]] = {}
        self._claimed = 0
        self._taken = 0
        self.error: BaseException | None = None
        for number in range(min(concurrency, len(chunks))):
            threading.Thread(target=self._work, name=f"dlo-read-{number}", daemon=True).start()

    def _work(self) -> None:
        while not self._stop.is_set():
            buffer = self._buffers.get(_POLL_S)
            if buffer is None:
                continue
            with self._cond:
                index = self._claimed
                self._claimed += 1
            if index >= len(self._chunks):
                self._buffers.put(buffer)
                return
            chunk = self._chunks[index]
            view = memoryview(buffer)[:chunk.length]
            try:
                self._read(chunk, view)
            except BaseException as exc:  # handed to the main thread, which reports it
                with self._cond:
                    self.error = self.error or exc
                    self._cond.notify_all()
                return
            # Hash here, while the bytes are hot and the other readers wait on the network.
            digest = hashlib.sha256(view).hexdigest()
            with self._cond:
                self._results[index] = (buffer, digest)
                self._cond.notify_all()

    def wait_ready(self, timeout: float) -> bool:
        """True when the next chunk is in memory (or a read failed: the caller checks `error`)."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self._taken in self._results or self.error is not None, timeout)

    def take(self) -> tuple[bytearray, str]:
        """The next chunk's buffer and SHA-256."""
        with self._cond:
            data = self._results.pop(self._taken)
            self._taken += 1
            return data


_WriteTask = tuple[Chunk, bytearray, Callable[[bytearray], None], str | None]


class _Writer:
    """Writes chunks (hashing those that arrive without a digest) on a few daemon threads;
    records one digest per chunk."""

    def __init__(self, plan: Plan, sink: FileSink | None, progress: Progress) -> None:
        self.digests: list[str | None] = [None] * len(plan.chunks)
        self.error: BaseException | None = None
        self._sink, self._progress = sink, progress
        self._queue: queue.Queue[_WriteTask] = queue.Queue()
        for number in range(_WRITER_THREADS):
            threading.Thread(target=self._work, name=f"dlo-write-{number}", daemon=True).start()

    def submit(self, chunk: Chunk, data: bytearray, give_back: Callable[[bytearray], None],
               digest: str | None = None) -> None:
        """Write `data` (hash it unless `digest` is given), then hand the buffer to `give_back`
        for reuse."""
        self._queue.put((chunk, data, give_back, digest))

    def drain(self) -> None:
        self._queue.join()

    def _work(self) -> None:
        while True:
            chunk, data, give_back, digest = self._queue.get()
            try:
                view = memoryview(data)[:chunk.length]
                if self.error is None:
                    self.digests[chunk.index] = digest or hashlib.sha256(view).hexdigest()
                    if self._sink is not None:
                        self._sink.write(chunk, view)
                    self._progress.add(written=chunk.length)
            except BaseException as exc:  # reported by the main thread at the next round
                self.error = self.error or exc
            finally:
                give_back(data)
                self._queue.task_done()


class Exchange:
    """One fill's data path. `run()` returns the SHA-256 of every chunk, by chunk index."""

    def __init__(self, plan: Plan, *, rank: int, group: Group | None, read: Reader,
                 sink: FileSink | None, progress: Progress, config: LoaderConfig,
                 deadline: float, stop: threading.Event) -> None:
        self.plan, self.group, self.progress = plan, group, progress
        self.rank = rank if group is not None else 0
        self.deadline, self.stop, self.timeout_s = deadline, stop, config.timeout_s
        buffers = max(config.memory_limit_bytes // plan.chunk_bytes, 2)
        receive = min(2, buffers - 1) if group is not None else 0
        self._receive = _Buffers(receive, plan.chunk_bytes)
        self._fetched = _Buffers(buffers - receive, plan.chunk_bytes)
        self._writer = _Writer(plan, sink, progress)
        self._fetcher = _Fetcher(plan.owned(self.rank), read, stop=stop, buffers=self._fetched,
                                 concurrency=min(config.readers, buffers - receive))

    def run(self) -> list[str]:
        try:
            if self.group is None:
                self._run_alone()
            else:
                self._run_group()
        finally:
            self.stop.set()  # readers still retrying must give up now
        digests = self._writer.digests
        missing = [index for index, digest in enumerate(digests) if digest is None]
        if missing:
            raise LoaderError(f"chunks {missing[:8]} were never written; the plan is inconsistent")
        return [d for d in digests if d is not None]

    def _run_alone(self) -> None:
        for chunk in self.plan.owned(self.rank):
            while not self._fetcher.wait_ready(_POLL_S):
                self._raise_problem()
            self._raise_problem()
            data, digest = self._fetcher.take()
            self._writer.submit(chunk, data, self._fetched.put, digest)
        self._writer.drain()
        self._raise_problem()

    def _run_group(self) -> None:
        peers = self.plan.world_size - 1
        for round_chunks in self.plan.rounds:
            self._await_round(any(c.owner == self.rank for c in round_chunks))
            for chunk in round_chunks:
                if chunk.owner == self.rank:
                    data, digest = self._fetcher.take()
                    self.group.broadcast(memoryview(data)[:chunk.length], src=self.rank)
                    self.progress.add(to_peers=chunk.length * peers)
                    self._writer.submit(chunk, data, self._fetched.put, digest)
                else:
                    data = self._receive_buffer()
                    self.group.broadcast(memoryview(data)[:chunk.length], src=chunk.owner)
                    self.progress.add(from_peers=chunk.length)
                    self._writer.submit(chunk, data, self._receive.put)
        self._writer.drain()
        self._await_round(False)  # the last writes' outcome, agreed by every rank

    def _await_round(self, has_chunk: bool) -> None:
        """Status exchanges until every rank is ready; raise if any rank failed."""
        while True:
            ready = not has_chunk or self._fetcher.wait_ready(_POLL_S)
            problem = self._problem()
            status = self.group.status(failed=problem is not None, ready=ready and problem is None)
            if problem is not None:
                raise problem
            if status.failed:
                raise GroupError(
                    f"loader rank {status.failed[0]} of {self.plan.world_size} failed; this "
                    "loader stops too and publishes nothing",
                    hint=f"see the log of rank {status.failed[0]} for the cause, then rerun",
                )
            if status.all_ready:
                return

    def _receive_buffer(self) -> bytearray:
        while (buffer := self._receive.get(_POLL_S)) is None:
            self._raise_problem()
        return buffer

    def _problem(self) -> BaseException | None:
        problem = self._fetcher.error or self._writer.error
        if problem is None and time.monotonic() > self.deadline:
            problem = LoaderError(
                f"the fill did not finish within loader.timeout_s={self.timeout_s:g} s",
                hint="raise loader.timeout_s, or check the object store's throughput",
            )
        return problem

    def _raise_problem(self) -> None:
        problem = self._problem()
        if problem is not None:
            raise problem
