"""The data path of one fill: fetch this rank's chunks, exchange them with the group, write and
hash every chunk, within a fixed memory budget.

Owns the pipeline and its bounds. Alone, `stream.ChunkStreams` streams every chunk from the
store to its place on disk (see [Note: streaming alone] in `stream`). With a group,
`fetch.Fetcher` reads this rank's chunks into chunk buffers (many ranged GETs at once, in the
shape `schedule.fetch_shape` gives) and hashes each, the main thread walks the plan's rounds: a
status exchange (who failed, who is ready), then the round's chunks go round the ring (see
[Note: ring]), and a few writer threads write every chunk at its offset (hashing the ones
received from peers). Called by `fill`. Must not decide policy (modes, fallback, publication) or
touch the object store directly (it gets `read` and `stream` callables).

[Note: ring] Round `k` holds the `k`-th chunk of each rank that has one, and is one all-gather:
gloo runs it as a ring (in N - 1 steps every rank passes the chunk it got last to rank + 1 while
receiving the next from rank - 1), so every link carries a chunk in every step, and each rank
sends and receives about (N - 1)/N of the model in all, at the peer link's rate, whatever N is;
the broadcast from one root it replaces cost N - 1 transfers per chunk on the root's link. Every
rank contributes the round's longest chunk length, rounded up to a page (a rank without a
chunk, or with a shorter last chunk, sends padding, dropped on receipt): only the last round of
a file is short. One call per round keeps the per-step work in gloo's threads, not the
interpreter's.

[Note: round buffers] A round arrives in one buffer of N chunk slots, rank by rank, which gloo
fills in place (`Group.all_gather_into`); a list of N outputs would have torch gather into a flat
tensor of its own and copy every received byte out again (about 6% of all CPU of an 8-node fill
on 2 cores). Slots are page-aligned, so the writers write each received chunk straight from its
slot with direct I/O; the buffer goes back to the pool when the last of its chunks is written.

[Note: memory bound] `memory_limit_bytes // chunk_bytes` buffers exist at most: with a group,
`ROUND_BUFFERS` round buffers of N slots (one round arriving while the last one is written) and
the rest for fetched chunks, which a reader takes a buffer for before it opens a chunk and the
writer returns once the chunk is on disk (and forwarded). Readers open chunks in plan order, so
the chunk the main thread waits for always holds a buffer or is done: no deadlock. Alone, no
chunk buffer exists: each reader streams through one `stream.PIECE_BYTES` buffer.

[Note: reading before the group] The plan is a pure function of the listing and the settings, so a
rank that will join a group builds it and starts reading its own chunks at once, then joins: the
rendezvous (which waits for the last loader to start, seconds apart in a rollout) and the plan
agreement overlap its first reads, up to the fetch buffers' bound. Chunks wait in their buffers
for their round. If the group does not form and the loader falls back to reading alone, the
exchange is abandoned and a new plan read from the start; if the plans differ across ranks, the
agreement fails before any byte is written or exchanged.

[Note: failing together] Every failure (a read that gave up, a write error, the deadline) is
reported in the next round's status exchange, so all ranks raise in the same round. A rank that
dies instead closes its sockets, which fails the others' next collective at once.
"""

from __future__ import annotations

import mmap
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from dlo_loader.digest import chunk_digest
from dlo_loader.errors import GroupError, LoaderError
from dlo_loader.fetch import POLL_S, BufferPool, Fetcher, Reader, Span, chunk_buffer, span_of
from dlo_loader.plan import Chunk, Plan
from dlo_loader.progress import Progress
from dlo_loader.schedule import fetch_shape
from dlo_loader.sink import ALIGN, FileSink
from dlo_loader.stream import ChunkStreams, Streamer, streamer_of
from dlo_contract.settings import LoaderConfig

if TYPE_CHECKING:  # transport imports torch: only fills with a group load it
    from dlo_loader.transport import Group

__all__ = ["Exchange", "Reader"]
ROUND_BUFFERS = 2
"""Round buffers (each a chunk slot per rank): one round arriving while the last is written."""
_WRITER_THREADS = max(2, min(4, os.cpu_count() or 1))
"""Hashing (the digest releases the GIL) and positioned writes of several chunks at once."""

_WriteTask = tuple[Chunk, memoryview, Callable[[], None], str | None]


class _Writer:
    """Writes chunks (hashing those that arrive without a digest) on a few daemon threads;
    records one digest per chunk."""

    def __init__(self, plan: Plan, sink: FileSink | None, progress: Progress) -> None:
        self.digests: list[str | None] = [None] * len(plan.chunks)
        self.error: BaseException | None = None
        self._sink, self._progress = sink, progress
        self._queue: queue.Queue[_WriteTask | None] = queue.Queue()
        for number in range(_WRITER_THREADS):
            threading.Thread(target=self._work, name=f"dlo-write-{number}", daemon=True).start()

    def close(self) -> None:
        """End the threads once the queued writes are done. A thread waiting for work holds its
        last task's buffer and pool, which would keep every chunk buffer of the fill alive in a
        loader that stays up after it (the pod's sidecar)."""
        for _ in range(_WRITER_THREADS):
            self._queue.put(None)

    def submit(self, chunk: Chunk, view: memoryview, release: Callable[[], None],
               digest: str | None = None) -> None:
        """Write the chunk's bytes `view` (hash them unless `digest` is given), then call
        `release` (its buffer may be reused)."""
        self._queue.put((chunk, view, release, digest))

    def drain(self) -> None:
        self._queue.join()

    def _work(self) -> None:
        while (task := self._queue.get()) is not None:
            chunk, view, release, digest = task
            try:
                if self.error is None:
                    if digest is None:
                        began = time.monotonic()
                        digest = chunk_digest(view)
                        self._progress.timed("digest", time.monotonic() - began)
                    self.digests[chunk.index] = digest
                    if self._sink is not None:
                        began = time.monotonic()
                        self._sink.write(chunk, view)
                        self._progress.timed("write", time.monotonic() - began)
                    self._progress.add(written=chunk.length)
            except BaseException as exc:  # reported by the main thread at the next round
                self.error = self.error or exc
            finally:
                release()
                self._queue.task_done()
        self._queue.task_done()


class Exchange:
    """One fill's data path. `run()` returns the digest of every chunk, by chunk index."""

    def __init__(self, plan: Plan, *, rank: int, grouped: bool, read: Reader,
                 sink: FileSink | None, progress: Progress, config: LoaderConfig,
                 deadline: float, stop: threading.Event,
                 fetched: dict[Span, tuple[mmap.mmap, str]] | None = None,
                 stream: Streamer | None = None) -> None:
        """Reading starts here (see [Note: reading before the group]); `grouped`: `run` will
        be given the group the plan was made for; `fetched`: chunks an abandoned exchange read
        already (`abandon`), not read again; `stream`: how to read alone (see [Note: streaming
        alone] in `stream`; default: piece by piece through `read`)."""
        self.plan, self.grouped, self.progress = plan, grouped, progress
        self.group: Group | None = None
        self.rank = rank if grouped else 0
        self.deadline, self.stop, self.timeout_s = deadline, stop, config.timeout_s
        self._fetch_stop = threading.Event()
        """Stops this exchange's readers alone (`abandon`); `stop` also ends the store's retries."""
        buffers = max(config.memory_limit_bytes // plan.chunk_bytes, 2)
        receive = ROUND_BUFFERS * plan.world_size if grouped else 0
        if grouped and buffers - receive < 1:
            raise LoaderError(
                f"loader.memory_limit_bytes={config.memory_limit_bytes} holds {buffers} chunks "
                f"of {plan.chunk_bytes} bytes; {plan.world_size} loaders need at least "
                f"{receive + 1}", hint="raise loader.memory_limit_bytes or lower chunk_bytes")
        self._slot = _aligned(plan.chunk_bytes)
        """Bytes per rank in a round buffer: direct writes need every slot page-aligned."""
        self._rounds = BufferPool(ROUND_BUFFERS if grouped else 0, plan.world_size * self._slot)
        self._padding: mmap.mmap | None = None
        """What a rank without a chunk in a round sends (made on first need)."""
        self._writer = _Writer(plan, sink, progress)
        owned, fetched = plan.owned(self.rank), fetched or {}
        self._fetched = [(c, fetched[span_of(c)]) for c in owned if span_of(c) in fetched]
        """Chunks of this plan read by an abandoned exchange: written first, not read again."""
        to_read = tuple(c for c in owned if span_of(c) not in fetched)
        self._streams: ChunkStreams | None = None
        if not grouped:
            if sink is None:
                raise LoaderError("an exchange without a group writes what it reads: it needs "
                                  "a sink")
            self._streams = ChunkStreams(to_read, stream or streamer_of(read), sink,
                                         readers=config.readers, stop=self._fetch_stop,
                                         progress=progress)
            to_read = ()
        fetch_buffers = max(buffers - receive - len(self._fetched), 1)
        shape = fetch_shape(chunk_bytes=plan.chunk_bytes, readers=config.readers,
                            buffers=fetch_buffers)
        self._fetcher = Fetcher(to_read, read, shape=shape, stop=self._fetch_stop,
                                pool=BufferPool(fetch_buffers, self._slot),
                                timed=progress.timed)

    def abandon(self) -> dict[Span, tuple[mmap.mmap, str]]:
        """Stop reading for this plan (the group it was made for did not form): a read in flight
        finishes unused, nothing is written. Returns the complete chunks, for the exchange of
        the plan that replaces this one."""
        self._fetch_stop.set()
        self._writer.close()
        return self._fetcher.take_all_ready()

    def run(self, group: Group | None = None) -> list[str]:
        """Exchange (with the `group` the plan was made for), write and hash every chunk."""
        if (group is not None) != self.grouped:
            raise LoaderError(f"an exchange planned {'with' if self.grouped else 'without'} a "
                              "group must run that way")
        self.group = group
        try:
            if self.group is None:
                self._run_alone()
            else:
                self._run_group()
        finally:
            self._fetch_stop.set()
            self.stop.set()  # readers still retrying must give up now
            self._writer.close()
        digests = self._writer.digests
        missing = [index for index, digest in enumerate(digests) if digest is None]
        if missing:
            raise LoaderError(f"chunks {missing[:8]} were never written; the plan is inconsistent")
        return [d for d in digests if d is not None]

    def _run_alone(self) -> None:
        """Nothing waits on the order: chunks stream to disk as they arrive."""
        assert self._streams is not None
        for chunk, (data, digest) in self._fetched:  # read before a fallback: its own buffers
            self._writer.submit(chunk, memoryview(data)[:chunk.length], lambda: None, digest)
        self._fetched = []
        while not self._streams.wait(POLL_S):
            self._raise_problem()
        self._writer.drain()
        self._raise_problem()
        for index, digest in self._streams.digests.items():
            self._writer.digests[index] = digest

    def _run_group(self) -> None:
        for number, round_chunks in enumerate(self.plan.rounds):
            by_owner = {chunk.owner: chunk for chunk in round_chunks}
            self._await_round(number, self.rank in by_owner)
            began = time.monotonic()
            self._ring(number, by_owner)
            self.progress.timed("exchange", time.monotonic() - began)
        self._writer.drain()
        self._await_round(None, False)  # the last writes' outcome, agreed by every rank

    def _ring(self, number: int, by_owner: dict[int, Chunk]) -> None:
        """One round: every rank's chunk to every rank at once (see [Note: ring]), into one
        round buffer (see [Note: round buffers])."""
        assert self.group is not None
        stride = _aligned(max(chunk.length for chunk in by_owner.values()))
        mine = by_owner.get(self.rank)
        if mine is not None:
            _, data, digest = self._fetcher.take(number)
        else:
            data = self._padding = self._padding or chunk_buffer(self._slot)
        flat = self._round_buffer()
        self.group.all_gather_into(memoryview(data)[:stride],
                                   memoryview(flat)[:stride * self.plan.world_size])
        received = [chunk for origin, chunk in by_owner.items() if origin != self.rank]
        release = _Countdown(len(received), lambda: self._rounds.give_back(flat))
        if mine is not None:
            self.progress.add(to_peers=mine.length * (self.plan.world_size - 1))
            self._writer.submit(mine, memoryview(data)[:mine.length],
                                lambda: self._fetcher.give_back(data), digest)
        for chunk in received:
            self.progress.add(from_peers=chunk.length)
            at = chunk.owner * stride
            self._writer.submit(chunk, memoryview(flat)[at:at + chunk.length], release.one)

    def _await_round(self, number: int | None, has_chunk: bool) -> None:
        """Status exchanges until every rank is ready for round `number` (this rank: its
        `number`-th owned chunk is complete); raise if any rank failed."""
        while True:
            ready = not has_chunk or self._fetcher.wait_ready(POLL_S, number)
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

    def _round_buffer(self) -> mmap.mmap:
        while (buffer := self._rounds.wait(POLL_S)) is None:
            self._raise_problem()
        return buffer

    def _problem(self) -> BaseException | None:
        problem = (self._fetcher.error or self._writer.error
                   or (self._streams.error if self._streams is not None else None))
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


class _Countdown:
    """Calls `then` once `one` has been called `count` times (at once when `count` is 0)."""

    def __init__(self, count: int, then: Callable[[], None]) -> None:
        self._left, self._then = count, then
        self._lock = threading.Lock()
        if not count:
            then()

    def one(self) -> None:
        with self._lock:
            self._left -= 1
            done = self._left == 0
        if done:
            self._then()


def _aligned(length: int) -> int:
    """`length` rounded up to the direct-write alignment."""
    return -(-length // ALIGN) * ALIGN
