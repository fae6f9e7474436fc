"""What travels with each chunk of a round, and how a posted round is tracked.

Owns the wire format of a round's slots (a chunk, then the page carrying its sender's
`RoundState`), the record of a round posted to the group (`Posted`), the countdown that returns
a round buffer once its last chunk is written (`Countdown`) and the direct-write alignment of
slot widths (`aligned`). Called by `ring`; it does no I/O and calls no collective.

[Note: round state] Each rank's slot carries one page more than its chunk, its `RoundState` for the
round: `READY` (its chunk, or nothing to send), `FAILED` (a read gave up, a write failed, the
deadline passed) or `LATE` (its chunk was not complete after `ring.LATE_AFTER_S`). A rank joins
round `k` as soon as its chunk is complete, so a round costs one collective: a separate status
exchange before every round cost a small all-reduce's latency in every round, and on an 8-node fill
the ring fell behind the reads by that much. When every state is `READY` the round is done; any
`FAILED` and every rank raises in that round (see [Note: failing together] in `ring`); any
`LATE` and no rank keeps the round: they exchange statuses (small all-reduces, polled) until every
rank is ready, then run the round again. `ring.LATE_AFTER_S` bounds how long ready ranks wait
inside the collective for a slow one, far below the collective's timeout, so a store that stalls
for minutes costs one wasted round, not a timeout.
"""

from __future__ import annotations

import enum
import mmap
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass

from dlo_loader.errors import GroupError
from dlo_loader.plan import Chunk
from dlo_loader.sink import ALIGN

STATE_BYTES = ALIGN
"""The page after each slot of a round that carries the sender's `RoundState`; a whole page keeps
every slot page-aligned for direct writes."""
STATE = struct.Struct("<q")


class RoundState(enum.IntEnum):
    """What a rank says of itself in a round (see [Note: round state])."""

    READY = 1
    LATE = 2
    FAILED = 3


@dataclass(kw_only=True)
class Posted:
    """A round posted to the group (see [Note: rounds in flight] in `ring`)."""

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


class Countdown:
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


def state_at(flat: mmap.mmap, at: int, rank: int) -> RoundState:
    """The round state rank `rank` sent, read from its slot of a round buffer."""
    (value,) = STATE.unpack_from(flat, at)
    try:
        return RoundState(value)
    except ValueError:
        raise GroupError(f"loader rank {rank} sent a round state {value} this loader does not "
                         "know", hint="run the same loader version on every node") from None


def aligned(length: int) -> int:
    """`length` rounded up to the direct-write alignment."""
    return -(-length // ALIGN) * ALIGN
