"""The data path of one fill: fetch this rank's chunks, exchange them with the group, write and
hash every chunk, within a fixed memory budget.

Owns the pipeline and its bounds. Alone, `stream.ChunkStreams` streams every chunk from the
store to its place on disk (see [Note: streaming alone] in `stream`). With a group,
`fetch.Fetcher` reads this rank's chunks into chunk buffers (many ranged GETs at once, in the
shape `schedule.fetch_shape` gives) and hashes each, the main thread walks the plan's rounds
(each rank's chunk and its state go round the ring: see [Note: ring], and [Note: round state]
in `rounds`), and a few writer threads (`chunk_writer`) write every chunk at its offset (hashing
the ones received from peers), all within the budget `exchange_budget` computes.
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

[Note: reading before the group] The plan is a pure function of the listing, the settings and
which members' nodes hold the entry, so once every member has taken its node's publication (the
loader's [Note: node order] in `claim`: the members hold nothing while they gather) a rank builds
it and starts reading its own chunks at once, then forms the process group: the group's
formation and the plan agreement overlap its first reads, up to the fetch buffers' bound. Chunks
wait in their buffers for their round. If the group does not form, the exchange is abandoned
and the fill fails; if the plans differ across ranks, the agreement fails before any byte is
written or exchanged.

[Note: kept after a loss] A member lost mid-exchange (`MemberLost`) does not stop this rank's
reads: `settle` opens no further chunk, gives the reads in flight up to `LATE_AFTER_S` to
complete the open ones (those take no more than a chunk's read each, which would otherwise be
read again from the store), and writes every chunk this rank read whole and never saw
delivered: those still in the fetcher and its own chunk of each round the loss cut short. That
one lies whole in its send buffer, which a collective cut short may still hold: gloo only reads
a send buffer (it copies it into its own output first) and the round's state goes in the page
after the chunk, so its bytes are those read and hashed; the buffer never goes back to a pool
(`settle` releases them). The survivors then re-read from the store only what no survivor
holds (`replan`).

[Note: failing together] Every failure (a read that gave up, a write error, the deadline) is
reported in the next round's state (see [Note: round state] in `rounds`), so all ranks raise in
the same round. A rank that dies instead closes its sockets, which fails the others' next
collective at once.
"""

from __future__ import annotations

import collections
import logging
import mmap
import threading
import time
from typing import TYPE_CHECKING

from dlo_loader.chunk_writer import ChunkWriter
from dlo_loader.errors import GroupError, LoaderError, MemberLost
from dlo_loader.exchange_budget import BUFFERS, ROUNDS_IN_FLIGHT, Budget, memory_budget
from dlo_loader.fetch import POLL_S, BufferPool, Fetcher, Reader, Span, chunk_buffer, span_of
from dlo_loader.plan import Chunk, Plan
from dlo_loader.progress import Progress
from dlo_loader.rounds import (
    STATE, STATE_BYTES, Countdown, Posted, RoundState, aligned, state_at,
)
from dlo_loader.schedule import fetch_shape
from dlo_loader.sink import FileSink
from dlo_loader.stream import ChunkStreams, Streamer, streamer_of
from dlo_contract.field_names import Names, document_names
from dlo_contract.settings import LoaderConfig

if TYPE_CHECKING:  # transport imports torch: only fills with a group load it
    from dlo_loader.transport import Group

__all__ = ["ROUNDS_IN_FLIGHT", "Exchange", "Reader", "RoundState"]
log = logging.getLogger(__name__)
LATE_AFTER_S = 5.0
"""How long a rank waits for its own chunk before it joins a round as `LATE` (see
[Note: round state] in `rounds`): ready ranks wait this long inside the collective for it."""


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
        budget = memory_budget(plan, config, grouped=grouped, names=names, held=BUFFERS.held)
        self._slot, self._in_flight = budget.slot, budget.in_flight
        if grouped:
            log.info("exchange: %d round(s) in flight, %d chunk buffers of %d bytes",
                     budget.in_flight, budget.buffers, budget.slot)
        self._rounds = BufferPool(budget.in_flight + 1 if grouped else 0,
                                  plan.world_size * budget.slot, BUFFERS)
        self._taken: dict[int, tuple[Chunk, mmap.mmap, str]] = {}
        """This rank's chunks in rounds posted and not delivered, by chunk index: what a loss
        leaves to `settle` (see [Note: kept after a loss])."""
        self._paddings: dict[int, mmap.mmap] = {}
        """What a rank without a chunk in a round sends, one per round in flight (made on first
        need): the page after it carries that round's state."""
        self._writer = ChunkWriter(plan, sink, progress)
        self._start_reading(budget, config, read, sink, fetched or {}, stream)

    def _start_reading(self, budget: Budget, config: LoaderConfig, read: Reader,
                       sink: FileSink | None, fetched: dict[Span, tuple[mmap.mmap, str]],
                       stream: Streamer | None) -> None:
        """Start this rank's reads: alone, streams to the sink; with a group, the fetcher into
        the chunk buffers the budget leaves beside the rounds'."""
        owned = self.plan.owned(self.rank)
        self._fetched = [(c, fetched[span_of(c)]) for c in owned if span_of(c) in fetched]
        """Chunks of this plan read by an abandoned exchange: written first, not read again."""
        to_read = tuple(c for c in owned if span_of(c) not in fetched)
        self._streams: ChunkStreams | None = None
        if not self.grouped:
            if sink is None:
                raise LoaderError("an exchange without a group writes what it reads: it needs "
                                  "a sink")
            algorithms = self.plan.algorithms
            self._streams = ChunkStreams(to_read, stream or streamer_of(read, algorithms), sink,
                                         algorithms=algorithms, readers=config.readers,
                                         stop=self._fetch_stop, progress=self.progress)
            to_read = ()
        fetch_buffers = budget.fetch_buffers(len(self._fetched))
        shape = fetch_shape(chunk_bytes=self.plan.chunk_bytes, readers=config.readers,
                            buffers=fetch_buffers)
        self._fetch_pool = BufferPool(fetch_buffers, budget.slot, BUFFERS)
        self._fetcher = Fetcher(to_read, read, shape=shape, stop=self._fetch_stop,
                                algorithms=self.plan.algorithms, pool=self._fetch_pool,
                                timed=self.progress.timed)

    def abandon(self) -> dict[Span, tuple[mmap.mmap, str]]:
        """Stop reading for this plan (the group it was made for did not form): a read in flight
        finishes unused, nothing is written. Returns the complete chunks, for the exchange of
        the plan that replaces this one."""
        self._fetch_stop.set()
        self._writer.close()
        return self._fetcher.take_all_ready()

    def settle(self) -> dict[int, str]:
        """Once `run` ended for good (a member was lost): let the reads in flight complete
        their chunks, stop reading, write every chunk read whole and never delivered (see
        [Note: kept after a loss]; with no sink, this rank serves its entry: their digests
        only), free every buffer but those a collective cut short still holds, and return what
        this rank holds (`held`), so the exchange that follows has the memory budget (see
        [Note: memory bound] in `exchange_budget`)."""
        self._fetcher.open_no_more()
        until = time.monotonic() + LATE_AFTER_S
        while not self._fetcher.wait_open(POLL_S) and time.monotonic() < until:
            pass
        kept = self.abandon()
        self._writer.drain()
        for chunk in self.plan.owned(self.rank):
            found = kept.pop(span_of(chunk), None)
            if found is not None:
                self._writer.write_here(chunk, memoryview(found[0])[:chunk.length], found[1])
        for chunk, data, digest in self._taken.values():  # their buffers: never reused
            self._writer.write_here(chunk, memoryview(data)[:chunk.length], digest)
        self._fetched, self._taken, self._paddings = [], {}, {}
        self._rounds.release()
        self._fetch_pool.release()
        return self.held()

    def held(self) -> dict[int, str]:
        """Once `run` ended (a member was lost): the chunks this rank wrote whole, with their
        digests, after the writes queued before the end are done (what `replan` keeps); a rank
        that serves its entry (no sink) writes nothing: every digest it learned."""
        self._writer.drain()
        if self._writer.sink is None:
            return {i: d for i, d in enumerate(self._writer.digests) if d is not None}
        return dict(self._writer.written)

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
        except MemberLost:  # reads in flight go on for `settle` ([Note: kept after a loss])
            self._writer.close()
            raise
        except BaseException:
            self._stop_reading()
            raise
        self._stop_reading()
        digests = self._writer.digests
        missing = [index for index, digest in enumerate(digests) if digest is None]
        if missing:
            raise LoaderError(f"chunks {missing[:8]} were never written; the plan is inconsistent")
        return [d for d in digests if d is not None]

    def _stop_reading(self) -> None:
        self._fetch_stop.set()
        self.stop.set()  # readers still retrying must give up now
        self._writer.close()

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
        posted: collections.deque[Posted] = collections.deque()
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
              taken: tuple[mmap.mmap, str] | None, *, patient: bool = True) -> Posted:
        """Start round `number`: this rank's chunk (`taken` already, or once complete) and state
        to every rank (see [Note: ring], and [Note: round state] in `rounds`), into a round
        buffer (see [Note: round buffers])."""
        assert self.group is not None
        mine = by_owner.get(self.rank)
        if mine is not None and taken is None and self._wait_own(number, patient=patient):
            _, data, digest = self._fetcher.take(number)
            taken = data, digest
            self._taken[mine.index] = mine, data, digest
        problem = self._problem()
        state = (RoundState.FAILED if problem is not None
                 else RoundState.LATE if mine is not None and taken is None
                 else RoundState.READY)
        stride = aligned(max(chunk.length for chunk in by_owner.values()))
        send = taken[0] if taken is not None else self._padding_buffer(number)
        STATE.pack_into(send, stride, state)
        flat = self._round_buffer()
        width = stride + STATE_BYTES
        wait = self.group.all_gather_into(memoryview(send)[:width],
                                          memoryview(flat)[:width * self.plan.world_size])
        return Posted(number=number, by_owner=by_owner, stride=stride, flat=flat, taken=taken,
                       state=state, problem=problem, wait=wait)

    def _settle(self, posted: collections.deque[Posted]) -> None:
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

    def _finish(self, round_: Posted) -> bool:
        """Wait for a posted round; deliver it when every rank was ready (True), else give its
        buffer back (False: it runs again); raise when any rank failed."""
        began = time.monotonic()
        round_.wait()
        self.progress.timed("exchange", time.monotonic() - began)
        states = [state_at(round_.flat, rank * round_.width + round_.stride, rank)
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

    def _deliver(self, round_: Posted) -> None:
        """Hand every chunk of a completed round to the writers; the round buffer goes back to
        the pool once its last received chunk is written."""
        flat, width = round_.flat, round_.width
        received = [chunk for origin, chunk in round_.by_owner.items() if origin != self.rank]
        release = Countdown(len(received), lambda: self._rounds.give_back(flat))
        mine = round_.by_owner.get(self.rank)
        if mine is not None and round_.taken is not None:
            data, digest = round_.taken
            del self._taken[mine.index]
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
        assert self.group is not None
        member = self.group.member(rank)
        return GroupError(
            f"{member} failed; this loader stops too and publishes nothing", hint=f"{member.log_hint()} for the cause, then rerun")

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
