"""The data path of one fill: fetch this rank's chunks, exchange them with the group, write and
hash every chunk, within a fixed memory budget.

Owns the pipeline and its bounds. Alone, `stream.ChunkStreams` streams every chunk from the
store to its place on disk (see [Note: streaming alone] in `stream`). With a group,
`fetch.Fetcher` reads this rank's chunks into chunk buffers (many ranged GETs at once, in the
shape `schedule.fetch_shape` gives) and hashes each, the main thread walks the plan's rounds
(each rank's chunk and its state go round the ring: see [Note: ring], [Note: round state]), and
a few writer threads write every chunk at its offset (hashing the ones received from peers).
Called by `fill`. Must not decide policy (modes, fallback, publication) or touch the object store
directly (it gets `read` and `stream` callables).

[Note: ring] Round `k` holds the `k`-th chunk of each rank that has one, and is one all-gather:
gloo runs it as a ring (in N - 1 steps every rank passes the chunk it got last to rank + 1 while
receiving the next from rank - 1), so every link carries a chunk in every step, and each rank
sends and receives about (N - 1)/N of the model in all, at the peer link's rate, whatever N is;
the broadcast from one root it replaces cost N - 1 transfers per chunk on the root's link. Every
rank contributes the round's longest chunk length, rounded up to a page (a rank without a
chunk, or with a shorter last chunk, sends padding, dropped on receipt): only the last round of
a file is short. One call per round keeps the per-step work in gloo's threads, not the
interpreter's.

[Note: round state] Each rank's slot carries one page more than its chunk, its `RoundState`
for the round: `READY` (its chunk, or nothing to send), `FAILED` (a read gave up, a write
failed, the deadline passed) or `LATE` (its chunk was not complete after `LATE_AFTER_S`). A
rank joins round `k` as soon as its chunk is complete, so a round costs one collective: a
separate status exchange before every round cost a small all-reduce's latency in every round,
and on an 8-node fill the ring fell behind the reads by that much. When
every state is `READY` the round is done; any `FAILED` and every rank raises in that round
(see [Note: failing together]); any `LATE` and no rank keeps the round: they exchange statuses
(small all-reduces, polled) until every rank is ready, then run the round again. `LATE_AFTER_S`
bounds how long ready ranks wait inside the collective for a slow one, far below the
collective's timeout, so a store that stalls for minutes costs one wasted round, not a timeout.

[Note: round buffers] A round arrives in one buffer of N slots, rank by rank
(`Group.all_gather_into`). torch's gloo backend gathers into a flat tensor of its own and copies
each slot out of it (one copy of what arrives); point-to-point sends straight into the slots
avoid that copy and were faster at N = 8, but a loader whose peer was killed mid-round could
hang with them (the README's cluster section), so the ring stays.
Slots are page-aligned, so the writers write each received chunk straight from its slot with
direct I/O; the buffer goes back to the pool when the last of its chunks is written.

[Note: rounds in flight] Up to `ROUNDS_IN_FLIGHT` rounds are posted before the oldest is waited
for: while round `k` goes round the ring, this rank waits for its chunk of round `k + 1` and
posts it, so the ring's steps of one round fill the pauses between the other's (each step
waits for the slowest link, and a rank's chunk of the next round is ready before the ring
needs it). Rounds are settled in order and every rank sees the same states, so all ranks
take the same path: when any rank was late, every round in flight is settled first (a complete
one is delivered), then the late ones run again after the status exchanges.

[Note: memory bound] `memory_limit_bytes // slot` buffers exist at most (a slot: a chunk and the
page of its round state): with a group, a round buffer of N slots per round in flight and one
more (a round being written), and the rest for fetched chunks, which a reader takes a buffer
for before it opens a chunk and the writer returns once the chunk is on disk (and forwarded).
A budget too small for two rounds in flight (3N + 4 slots: two chunks sent, two read ahead)
runs one at a time (at least 2N + 1 slots). Readers open chunks in plan order, so the chunk
the main thread waits for always holds a buffer or is done: no deadlock. Alone, no chunk buffer
exists: each reader streams through one `stream.PIECE_BYTES` piece.

[Note: reading before the group] The plan is a pure function of the listing and the settings, so a
rank that will join a group builds it and starts reading its own chunks at once, then joins: the
rendezvous (which waits for the last loader to start, seconds apart in a rollout) and the plan
agreement overlap its first reads, up to the fetch buffers' bound. Chunks wait in their buffers
for their round. If the group does not form and the loader falls back to reading alone, the
exchange is abandoned and a new plan read from the start; if the plans differ across ranks, the
agreement fails before any byte is written or exchanged.

[Note: failing together] Every failure (a read that gave up, a write error, the deadline) is
reported in the next round's state (see [Note: round state]), so all ranks raise in the same
round. A rank that dies instead closes its sockets, which fails the others' next collective at
once.
"""

from __future__ import annotations

import collections
import enum
import logging
import mmap
import os
import queue
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
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
from dlo_contract.field_names import Names, document_names

if TYPE_CHECKING:  # transport imports torch: only fills with a group load it
    from dlo_loader.transport import Group

__all__ = ["Exchange", "Reader"]
log = logging.getLogger(__name__)
ROUNDS_IN_FLIGHT = 2
"""Rounds posted to the group at once when the memory budget allows (see [Note: rounds in
flight]); each needs a round buffer, and one more is written meanwhile."""
LATE_AFTER_S = 5.0
"""How long a rank waits for its own chunk before it joins a round as `LATE` (see
[Note: round state]): ready ranks wait this long inside the collective for it."""
STATE_BYTES = ALIGN
"""The page after each slot of a round that carries the sender's `RoundState`; a whole page keeps
every slot page-aligned for direct writes."""
_STATE = struct.Struct("<q")
_WRITER_THREADS = max(2, min(4, os.cpu_count() or 1))
"""Hashing (the digest releases the GIL) and positioned writes of several chunks at once."""

_WriteTask = tuple[Chunk, memoryview, Callable[[], None], str | None]


class RoundState(enum.IntEnum):
    """What a rank says of itself in a round (see [Note: round state])."""

    READY = 1
    LATE = 2
    FAILED = 3


class _Writer:
    """Writes chunks (hashing those that arrive without a digest) on a few daemon threads;
    records one digest per chunk."""

    def __init__(self, plan: Plan, sink: FileSink | None, progress: Progress) -> None:
        self.digests: list[str | None] = [None] * len(plan.chunks)
        self.error: BaseException | None = None
        self._sink, self._progress = sink, progress
        self._algorithms = plan.algorithms
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
                        digest = chunk_digest(view, self._algorithms[chunk.file])
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
                 stream: Streamer | None = None, names: Names = document_names) -> None:
        """Reading starts here (see [Note: reading before the group]); `grouped`: `run` will
        be given the group the plan was made for; `fetched`: chunks an abandoned exchange read
        already (`abandon`), not read again; `stream`: how to read alone (see [Note: streaming
        alone] in `stream`; default: piece by piece through `read`); `names`: how messages
        spell the settings (the fill's namer)."""
        self._names = names
        self.plan, self.grouped, self.progress = plan, grouped, progress
        self.group: Group | None = None
        self.rank = rank if grouped else 0
        self.deadline, self.stop, self.timeout_s = deadline, stop, config.timeout_s
        self._fetch_stop = threading.Event()
        """Stops this exchange's readers alone (`abandon`); `stop` also ends the store's retries."""
        self._slot = _aligned(plan.chunk_bytes) + (STATE_BYTES if grouped else 0)
        """Bytes per chunk buffer and per rank in a round buffer: the chunk, then its round state
        (see [Note: round state]); direct writes need every slot page-aligned."""
        buffers = max(config.memory_limit_bytes // self._slot, 2)
        pipelined = buffers - (ROUNDS_IN_FLIGHT + 1) * plan.world_size >= 2 * ROUNDS_IN_FLIGHT
        self._in_flight = ROUNDS_IN_FLIGHT if pipelined else 1
        """Rounds posted at once: `ROUNDS_IN_FLIGHT` when the budget holds their round buffers
        (plus one being written) and fetch buffers for the chunks they send and as many read
        ahead, else one (see [Note: memory bound])."""
        receive = (self._in_flight + 1) * plan.world_size if grouped else 0
        if grouped and buffers - receive < 1:
            raise LoaderError(
                f"{names('loader.memory_limit_bytes')}={config.memory_limit_bytes} holds "
                f"{buffers} chunks of {plan.chunk_bytes} bytes (and a page each); "
                f"{plan.world_size} loaders need at least {receive + 1}",
                hint=f"raise {names('loader.memory_limit_bytes')} or lower "
                     f"{names('loader.chunk_bytes')}")
        if grouped:
            log.info("exchange: %d round(s) in flight, %d chunk buffers of %d bytes",
                     self._in_flight, buffers, self._slot)
        self._rounds = BufferPool(self._in_flight + 1 if grouped else 0,
                                  plan.world_size * self._slot)
        self._paddings: dict[int, mmap.mmap] = {}
        """What a rank without a chunk in a round sends, one per round in flight (made on first
        need): the page after it carries that round's state."""
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
            self._streams = ChunkStreams(to_read, stream or streamer_of(read, plan.algorithms),
                                         sink, algorithms=plan.algorithms,
                                         readers=config.readers, stop=self._fetch_stop,
                                         progress=progress)
            to_read = ()
        fetch_buffers = max(buffers - receive - len(self._fetched), 1)
        shape = fetch_shape(chunk_bytes=plan.chunk_bytes, readers=config.readers,
                            buffers=fetch_buffers)
        self._fetcher = Fetcher(to_read, read, shape=shape, stop=self._fetch_stop,
                                algorithms=plan.algorithms,
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
        posted: collections.deque[_Posted] = collections.deque()
        for number, round_chunks in enumerate(self.plan.rounds):
            # A rank late for the round before need not wait for this one's chunk again.
            patient = not posted or posted[-1].state is not RoundState.LATE
            posted.append(self._post(number, {c.owner: c for c in round_chunks}, None,
                                     patient=patient))
            if len(posted) == self._in_flight:
                self._settle(posted)
        while posted:
            self._settle(posted)
        self._writer.drain()
        self._await_round(None, False)  # the last writes' outcome, agreed by every rank

    def _post(self, number: int, by_owner: dict[int, Chunk],
              taken: tuple[mmap.mmap, str] | None, *, patient: bool = True) -> _Posted:
        """Start round `number`: this rank's chunk (`taken` already, or once complete) and state
        to every rank (see [Note: ring] and [Note: round state]), into a round buffer (see
        [Note: round buffers])."""
        assert self.group is not None
        mine = by_owner.get(self.rank)
        if mine is not None and taken is None and self._wait_own(number, patient=patient):
            _, data, digest = self._fetcher.take(number)
            taken = data, digest
        problem = self._problem()
        state = (RoundState.FAILED if problem is not None
                 else RoundState.LATE if mine is not None and taken is None
                 else RoundState.READY)
        stride = _aligned(max(chunk.length for chunk in by_owner.values()))
        send = taken[0] if taken is not None else self._padding_buffer(number)
        _STATE.pack_into(send, stride, state)
        flat = self._round_buffer()
        width = stride + STATE_BYTES
        wait = self.group.all_gather_into(memoryview(send)[:width],
                                          memoryview(flat)[:width * self.plan.world_size])
        return _Posted(number=number, by_owner=by_owner, stride=stride, flat=flat, taken=taken,
                       state=state, problem=problem, wait=wait)

    def _settle(self, posted: collections.deque[_Posted]) -> None:
        """Wait for the oldest round in flight and deliver it; when a rank was late for it,
        settle every round in flight, then run the late ones again once every rank is ready
        (status exchanges, which no round may be in flight for). Raises in the round in which
        any rank failed."""
        first = posted.popleft()
        if self._finish(first):
            return
        late = [first]
        while posted:
            round_ = posted.popleft()
            if not self._finish(round_):
                late.append(round_)
        for again in late:
            while True:
                self._await_round(again.number, again.state is RoundState.LATE)
                again = self._post(again.number, again.by_owner, again.taken)
                if self._finish(again):
                    break

    def _finish(self, round_: _Posted) -> bool:
        """Wait for a posted round; deliver it when every rank was ready (True), else give its
        buffer back (False: it runs again); raise when any rank failed."""
        began = time.monotonic()
        round_.wait()
        self.progress.timed("exchange", time.monotonic() - began)
        states = [_state_at(round_.flat, rank * round_.width + round_.stride, rank)
                  for rank in range(self.plan.world_size)]
        if all(s is RoundState.READY for s in states):
            self._deliver(round_)
            return True
        self._rounds.give_back(round_.flat)
        if round_.problem is not None:
            raise round_.problem
        if RoundState.FAILED in states:
            raise self._failed(states.index(RoundState.FAILED))
        late = [rank for rank, s in enumerate(states) if s is RoundState.LATE]
        log.info("round %d of %d: loader rank(s) %s not ready after %g s; the round runs "
                 "again once every rank is", round_.number + 1, len(self.plan.rounds),
                 ", ".join(map(str, late)), LATE_AFTER_S)
        return False

    def _deliver(self, round_: _Posted) -> None:
        """Hand every chunk of a completed round to the writers; the round buffer goes back to
        the pool once its last received chunk is written."""
        flat, width = round_.flat, round_.width
        received = [chunk for origin, chunk in round_.by_owner.items() if origin != self.rank]
        release = _Countdown(len(received), lambda: self._rounds.give_back(flat))
        mine = round_.by_owner.get(self.rank)
        if mine is not None and round_.taken is not None:
            data, digest = round_.taken
            self.progress.add(to_peers=mine.length * (self.plan.world_size - 1))
            self._writer.submit(mine, memoryview(data)[:mine.length],
                                lambda: self._fetcher.give_back(data), digest)
        for chunk in received:
            self.progress.add(from_peers=chunk.length)
            at = chunk.owner * width
            self._writer.submit(chunk, memoryview(flat)[at:at + chunk.length], release.one)

    def _wait_own(self, number: int, *, patient: bool = True) -> bool:
        """Wait up to `LATE_AFTER_S` (not `patient`: a moment) for this rank's chunk of round
        `number`; False when it is not complete by then, or a problem came first."""
        until = time.monotonic() + (LATE_AFTER_S if patient else 0.0)
        while not self._fetcher.wait_ready(POLL_S, number):
            if self._problem() is not None or time.monotonic() >= until:
                return False
        return self._fetcher.error is None

    def _padding_buffer(self, number: int) -> mmap.mmap:
        """What this rank sends in round `number` without a chunk of its own."""
        key = number % self._in_flight
        if key not in self._paddings:
            self._paddings[key] = chunk_buffer(self._slot)
        return self._paddings[key]

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
                raise self._failed(status.failed[0])
            if status.all_ready:
                return

    def _failed(self, rank: int) -> GroupError:
        return GroupError(
            f"loader rank {rank} of {self.plan.world_size} failed; this loader stops too and "
            "publishes nothing", hint=f"see the log of rank {rank} for the cause, then rerun")

    def _round_buffer(self) -> mmap.mmap:
        while (buffer := self._rounds.wait(POLL_S)) is None:
            self._raise_problem()
        return buffer

    def _problem(self) -> BaseException | None:
        problem = (self._fetcher.error or self._writer.error
                   or (self._streams.error if self._streams is not None else None))
        if problem is None and time.monotonic() > self.deadline:
            problem = LoaderError(
                f"the fill did not finish within {self._names('loader.timeout_s')}="
                f"{self.timeout_s:g} s",
                hint=f"raise {self._names('loader.timeout_s')}, or check the object store's "
                     "throughput",
            )
        return problem

    def _raise_problem(self) -> None:
        problem = self._problem()
        if problem is not None:
            raise problem


@dataclass(kw_only=True)
class _Posted:
    """A round posted to the group (see [Note: rounds in flight])."""

    number: int
    by_owner: dict[int, Chunk]
    stride: int
    """Bytes of chunk per rank in this round (its longest chunk, page-aligned)."""
    flat: mmap.mmap
    """The round buffer it arrives in."""
    taken: tuple[mmap.mmap, str] | None
    """This rank's chunk (buffer, digest), once complete."""
    state: RoundState
    problem: BaseException | None
    wait: Callable[[], None]

    @property
    def width(self) -> int:
        """Bytes per rank in this round: its chunk, then the page of its state."""
        return self.stride + STATE_BYTES


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


def _state_at(flat: mmap.mmap, at: int, rank: int) -> RoundState:
    """The round state rank `rank` sent, read from its slot of a round buffer."""
    (value,) = _STATE.unpack_from(flat, at)
    try:
        return RoundState(value)
    except ValueError:
        raise GroupError(f"loader rank {rank} sent a round state {value} this loader does not "
                         "know", hint="run the same loader version on every node") from None


def _aligned(length: int) -> int:
    """`length` rounded up to the direct-write alignment."""
    return -(-length // ALIGN) * ALIGN
