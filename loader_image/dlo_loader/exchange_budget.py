"""How one exchange spends the loader's memory budget: a pure computation, checked once.

Owns `memory_budget`: from the plan, the settings and whether a group takes part, the bytes of
one buffer slot, how many buffers the budget holds, how many rounds run at once and how many
buffers the rounds receive into; it refuses a budget that cannot hold one round. Also owns
`BUFFERS`, the account of the chunk and round buffers alive in this process (made by the pools
of `fetch.BufferPool`, credited when a buffer is freed), which the budget of a later exchange is
charged with (see [Note: memory bound]). Called by `exchange` before it allocates or reads
anything; it allocates nothing.

[Note: memory bound] `memory_limit_bytes // slot` buffers exist at most (a slot: a chunk and the
page of its round state): with a group, a round buffer of N slots per round in flight and one
more (a round being written), and the rest for fetched chunks, which a reader takes a buffer for
before it opens a chunk and the writer returns once the chunk is on disk (and forwarded). A
budget too small for two rounds in flight (3N + 4 slots: two chunks sent, two read ahead) runs
one at a time (at least 2N + 1 slots). Readers open chunks in plan order, so the chunk the main
thread waits for always holds a buffer or is done: no deadlock. Alone, no chunk buffer exists:
each reader streams through one `stream.PIECE_BYTES` piece.

The budget is what the limit leaves beside the buffers still alive (`BUFFERS.held`): a group
that lost a member runs the survivors' exchange while the first exchange's buffers that a
collective cut short by the loss still holds are alive (gloo may still write into them), so
the survivors' exchange gets the rest. The first exchange's other buffers are gone by then: the
chunks it read and never sent are written to the tmp dir and their buffers freed with its idle
ones (`Exchange.settle`). Where the rest cannot hold one round, the survivors' exchange takes
the least that can (where the whole limit can), and goes beyond the limit by that much.
(A rank without a chunk in a round sends a padding slot of its own, outside the pools: at most
one per round in flight.)
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass

from dlo_loader.errors import LoaderError
from dlo_loader.plan import Plan
from dlo_loader.rounds import STATE_BYTES, aligned
from dlo_contract.field_names import Names, document_names
from dlo_contract.settings import LoaderConfig

log = logging.getLogger(__name__)
ROUNDS_IN_FLIGHT = 2
"""Rounds posted to the group at once when the memory budget allows (see [Note: rounds in
flight] in `ring`); each needs a round buffer, and one more is written meanwhile."""


class BufferAccount:
    """The bytes of the chunk and round buffers alive in this process, and the most at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.held = 0
        self.peak = 0

    def charge(self, buffer: object, size: int) -> None:
        """Count `buffer` (of `size` bytes) until it is freed."""
        with self._lock:
            self.held += size
            self.peak = max(self.peak, self.held)
        weakref.finalize(buffer, self._credit, size)

    def _credit(self, size: int) -> None:
        with self._lock:
            self.held -= size


BUFFERS = BufferAccount()
"""The chunk and round buffers of this process's exchanges (see [Note: memory bound])."""


@dataclass(frozen=True)
class Budget:
    """One exchange's share of `loader.memory_limit_bytes` (see [Note: memory bound])."""

    slot: int
    """Bytes per chunk buffer and per rank in a round buffer: the chunk, then (with a group) its
    round state; direct writes need every slot page-aligned."""
    buffers: int
    """Slots the budget holds (at least two)."""
    in_flight: int
    """Rounds posted at once: `ROUNDS_IN_FLIGHT` when the budget holds their round buffers (plus
    one being written) and fetch buffers for the chunks they send and as many read ahead, else
    one."""
    receive: int
    """Slots held by round buffers (0 alone)."""

    @property
    def fetch_buffers(self) -> int:
        """Chunk buffers left for the readers beside the rounds'."""
        return max(self.buffers - self.receive, 1)


def memory_budget(plan: Plan, config: LoaderConfig, *, grouped: bool,
                  names: Names = document_names, held: int = 0) -> Budget:
    """The budget of an exchange of `plan` beside `held` bytes of buffers still alive (see
    [Note: memory bound]), or a `LoaderError` naming the settings (through `names`) when a
    group's rounds do not fit the limit."""
    slot = aligned(plan.chunk_bytes) + (STATE_BYTES if grouped else 0)
    buffers = max((config.memory_limit_bytes - held) // slot, 2)
    pipelined = buffers - (ROUNDS_IN_FLIGHT + 1) * plan.world_size >= 2 * ROUNDS_IN_FLIGHT
    in_flight = ROUNDS_IN_FLIGHT if pipelined else 1
    receive = (in_flight + 1) * plan.world_size if grouped else 0
    if grouped and buffers - receive < 1:
        if held and max(config.memory_limit_bytes // slot, 2) >= receive + 1:
            log.warning("exchange: %s=%d leaves %d bytes beside the %d bytes of buffers a "
                        "collective cut short still holds; this exchange takes the least that "
                        "holds one round (%d chunk buffers)",
                        names("loader.memory_limit_bytes"), config.memory_limit_bytes,
                        config.memory_limit_bytes - held, held, receive + 1)
            return Budget(slot=slot, buffers=receive + 1, in_flight=in_flight, receive=receive)
        raise LoaderError(
            f"{names('loader.memory_limit_bytes')}={config.memory_limit_bytes} holds "
            f"{max(config.memory_limit_bytes // slot, 2)} chunks of {plan.chunk_bytes} bytes "
            "(and a page each); "
            f"{plan.world_size} loaders need at least {receive + 1}",
            hint=f"raise {names('loader.memory_limit_bytes')} or lower "
                 f"{names('loader.chunk_bytes')}")
    return Budget(slot=slot, buffers=buffers, in_flight=in_flight, receive=receive)
