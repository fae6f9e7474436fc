"""The data path of one fill: fetch this rank's chunks, exchange them with the group, write and
hash every chunk, within a fixed memory budget.

Owns the pipeline and its bounds. Alone, `stream.ChunkStreams` streams every chunk from the
store to its place on disk (see [Note: streaming alone] in `stream`). With a group,
`fetch.Fetcher` reads this rank's chunks into chunk buffers (many ranged GETs at once, in the
shape `schedule.fetch_shape` gives) and hashes each, the main thread walks the plan's rounds
(`ring.Ring`: each rank's chunk and its state go round the ring), and a few writer threads
(`chunk_writer`) write every chunk at its offset (hashing the ones received from peers), all
within the budget `exchange_budget` computes. After a loss, it keeps what this rank read
(`settle`, see [Note: kept after a loss]).
Called by `transfer` and `survive`. Must not decide policy (modes, fallback, publication) or
touch the object store directly (it gets `read` and `stream` callables).

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
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from dlo_loader.chunk_writer import ChunkWriter
from dlo_loader.errors import LoaderError, MemberLost
from dlo_loader.exchange_budget import BUFFERS, ROUNDS_IN_FLIGHT, Budget, memory_budget
from dlo_loader.fetch import POLL_S, BufferPool, Fetcher, Reader, span_of
from dlo_loader.plan import Plan
from dlo_loader.progress import Progress
from dlo_loader.ring import LATE_AFTER_S, Ring
from dlo_loader.rounds import RoundState
from dlo_loader.schedule import fetch_shape
from dlo_loader.sink import FileSink
from dlo_loader.stream import ChunkStreams, Streamer, streamer_of
from dlo_contract.field_names import Names, document_names
from dlo_contract.settings import LoaderConfig

if TYPE_CHECKING:  # group imports torch: only fills with a group load it
    from dlo_loader.group import Group

__all__ = ["LATE_AFTER_S", "ROUNDS_IN_FLIGHT", "Exchange", "Reader", "RoundState"]
log = logging.getLogger(__name__)


class Exchange:
    """One fill's data path. `run()` returns the digest of every chunk, by chunk index."""

    def __init__(self, plan: Plan, *, rank: int, grouped: bool, read: Reader,
                 sink: FileSink | None, progress: Progress, config: LoaderConfig,
                 deadline: float, stop: threading.Event, stream: Streamer | None = None,
                 names: Names = document_names) -> None:
        """Reading starts here (see [Note: reading before the group]); `grouped`: `run` will
        be given the group the plan was made for; `stream`: how to read alone (see [Note:
        streaming alone] in `stream`; default: piece by piece through `read`); `names`: how
        messages spell the settings (the fill's namer)."""
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
        self._ring: Ring | None = None
        """The rounds with the group, once `run` was given it."""
        self._writer = ChunkWriter(plan, sink, progress)
        self._start_reading(budget, config, read, sink, stream)

    def _start_reading(self, budget: Budget, config: LoaderConfig, read: Reader,
                       sink: FileSink | None, stream: Streamer | None) -> None:
        """Start this rank's reads: alone, streams to the sink; with a group, the fetcher into
        the chunk buffers the budget leaves beside the rounds'."""
        to_read = tuple(self.plan.owned(self.rank))
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
        fetch_buffers = budget.fetch_buffers
        shape = fetch_shape(chunk_bytes=self.plan.chunk_bytes, readers=config.readers,
                            buffers=fetch_buffers)
        self._fetch_pool = BufferPool(fetch_buffers, budget.slot, BUFFERS)
        self._fetcher = Fetcher(to_read, read, shape=shape, stop=self._fetch_stop,
                                algorithms=self.plan.algorithms, pool=self._fetch_pool,
                                timed=self.progress.timed)

    def abandon(self) -> None:
        """Stop reading for this plan (the group it was made for did not form, or the fill
        ended): a read in flight finishes unused, nothing more is written."""
        self._fetch_stop.set()
        self._writer.close()

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
        self.abandon()
        kept = self._fetcher.take_all_ready()
        self._writer.drain()
        for chunk in self.plan.owned(self.rank):
            found = kept.pop(span_of(chunk), None)
            if found is not None:
                self._writer.write_here(chunk, memoryview(found[0])[:chunk.length], found[1])
        taken = self._ring.in_rounds if self._ring is not None else {}
        for chunk, data, digest in taken.values():  # their buffers: never reused
            self._writer.write_here(chunk, memoryview(data)[:chunk.length], digest)
        self._ring = None  # its paddings go
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
                self._ring = Ring(self.plan, self.group, rank=self.rank, fetcher=self._fetcher,
                                  writer=self._writer, rounds=self._rounds,
                                  progress=self.progress, in_flight=self._in_flight,
                                  slot=self._slot, problem=self._problem)
                self._ring.run()
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
        while not self._streams.wait(POLL_S):
            self._raise_problem()
        self._writer.drain()
        self._raise_problem()
        for index, digest in self._streams.digests.items():
            self._writer.digests[index] = digest

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
