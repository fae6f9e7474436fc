"""The rounds of one exchange with a group: this rank's chunks round the ring, every chunk
received handed to the writers.

Owns the round loop of `exchange.Exchange.run` with a group: it walks the plan's rounds, posts
each with this rank's chunk (taken from the fetcher) and state (see [Note: ring], and
[Note: round state] in `rounds`), settles the rounds in flight in order, runs again the rounds
a late rank held up, and delivers every completed round to the writers. It records this rank's
chunks posted and not delivered (`Ring.in_rounds`) for the exchange to keep after a loss (see
[Note: kept after a loss] in `exchange`). Called by `exchange`, which owns the fetcher, the
writers, the buffer pools and what counts as a problem. Must not read, write files or decide
the memory budget.

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

[Note: failing together] Every failure (a read that gave up, a write error, the deadline) is
reported in the next round's state (see [Note: round state] in `rounds`), so all ranks raise in
the same round. A rank that dies instead closes its sockets, which fails the others' next
collective at once.
"""

from __future__ import annotations

import collections
import logging
import mmap
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from dlo_loader.chunk_writer import ChunkWriter
from dlo_loader.errors import GroupError
from dlo_loader.fetch import POLL_S, BufferPool, Fetcher, chunk_buffer
from dlo_loader.plan import Chunk, Plan
from dlo_loader.progress import Progress
from dlo_loader.rounds import (
    STATE, STATE_BYTES, Countdown, Posted, RoundState, aligned, state_at,
)

if TYPE_CHECKING:  # group imports torch: only fills with a group load it
    from dlo_loader.group import Group

log = logging.getLogger(__name__)
LATE_AFTER_S = 5.0
"""How long a rank waits for its own chunk before it joins a round as `LATE` (see
[Note: round state] in `rounds`): ready ranks wait this long inside the collective for it."""


class Ring:
    """The rounds of `plan` with `group`; `run()` hands every chunk to `writer`, or raises
    in the round in which any rank failed (`problem()`: this rank's, or None)."""

    def __init__(self, plan: Plan, group: Group, *, rank: int, fetcher: Fetcher,
                 writer: ChunkWriter, rounds: BufferPool, progress: Progress, in_flight: int,
                 slot: int, problem: Callable[[], BaseException | None]) -> None:
        self.plan, self.group, self.rank = plan, group, rank
        self._fetcher, self._writer, self._rounds = fetcher, writer, rounds
        self.progress, self._in_flight, self._slot = progress, in_flight, slot
        self._problem = problem
        self.in_rounds: dict[int, tuple[Chunk, mmap.mmap, str]] = {}
        """This rank's chunks in rounds posted and not delivered, by chunk index: what a loss
        leaves to the exchange to keep (see [Note: kept after a loss] in `exchange`)."""
        self._paddings: dict[int, mmap.mmap] = {}
        """What a rank without a chunk in a round sends, one per round in flight (made on first
        need): the page after it carries that round's state."""

    def run(self) -> None:
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
        mine = by_owner.get(self.rank)
        if mine is not None and taken is None and self._wait_own(number, patient=patient):
            _, data, digest = self._fetcher.take(number)
            taken = data, digest
            self.in_rounds[mine.index] = mine, data, digest
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
            del self.in_rounds[mine.index]
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
        member = self.group.member(rank)
        return GroupError(f"{member} failed; this loader stops too and publishes nothing",
                          hint=f"{member.log_hint()} for the cause, then rerun")

    def _round_buffer(self) -> mmap.mmap:
        while (buffer := self._rounds.wait(POLL_S)) is None:
            problem = self._problem()
            if problem is not None:
                raise problem
        return buffer
