"""A fill that goes on without a member its group lost.

Owns the steps after the heartbeat found a member lost mid-exchange: the survivors form a group
again (`regroup`), gather what each holds (the chunks it wrote whole, and those it read but
never sent, still in memory), re-plan what is still missing (`replan`), and run that plan's
exchange in the survivors' group, each reading what it holds from memory or its own tmp dir
and from the store what no survivor holds. Returns every chunk's digest in the first
plan's order, for the usual checks and the commit (`transfer`). Called by `transfer`. Must not
commit, take locks or decide the first plan.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dlo_loader import digest
from dlo_loader.checks import agree
from dlo_loader.errors import GroupError
from dlo_loader.fetch import span_of
from dlo_loader.regroup import survivors_of
from dlo_loader.replan import Replan, replan
from dlo_contract.units import human_bytes

if TYPE_CHECKING:
    import mmap

    from dlo_loader.exchange import Exchange, Reader
    from dlo_loader.fetch import Span
    from dlo_loader.peers import Loss
    from dlo_loader.plan import Plan
    from dlo_loader.transport import Group

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Survived:
    """What the survivors' exchange gave: the digests, the group to end the fill in, and what
    the loss cost."""

    digests: list[str]
    group: Group
    without: tuple[int, ...]
    """The ranks (of the group every member formed) the fill finished without."""
    read_again: int
    """Bytes this rank read again from the store for the lost member."""


def go_on(*, plan: Plan, group: Group, loss: Loss, first: Exchange, tmp_dir: Path,
          store_read: Reader, exchange_of: Callable[[Plan, int, Reader], Exchange],
          whole: bool = False) -> Survived:
    """Finish the fill of `plan` in a group of the survivors of `group` (see the module
    docstring); `first`: the exchange the loss cut short; `tmp_dir`: where this rank's chunks
    lie (`whole`: its node's entry, which holds every chunk); `store_read`: reads from the store;
    `exchange_of(plan, rank, read)` starts an exchange. Raises the loss's error where the
    survivors cannot go on (rank 0 lost, this member dropped, a second loss)."""
    fetched = first.abandon()  # its reads stop; the chunks it read and never sent are kept
    index = {span_of(c): c.index for c in plan.chunks}
    in_memory = {} if whole else {index[span]: found for span, (_, found) in fetched.items()}
    held = first.held() | in_memory
    survivors = survivors_of(group, loss)
    try:
        return _finish(plan, survivors, group, loss, (held, list(in_memory), whole),
                       _reader_of(tmp_dir, store_read, fetched), exchange_of)
    except BaseException as exc:  # the other survivors name this one and why it left
        survivors.close(exc)
        raise


def _finish(plan: Plan, survivors: Group, group: Group, loss: Loss,
            holding: tuple[dict[int, str], list[int], bool],
            reader_of: Callable[[Replan, int], Reader],
            exchange_of: Callable[[Plan, int, Reader], Exchange]) -> Survived:
    """The survivors' re-plan and exchange (see `go_on`)."""
    held = holding[0]
    gathered = survivors.all_gather_object(holding)
    try:
        again = replan(plan, survivors.ranks, [h for h, _, _ in gathered],
                       [m for _, m, _ in gathered], [w for _, _, w in gathered])
    except ValueError as exc:
        raise GroupError(f"the survivors cannot go on without {loss.member}: {exc}",
                         hint="rerun every loader of the group") from exc
    mine = [c for i, c in enumerate(again.plan.chunks) if c.owner == survivors.rank
            and i not in again.from_disk]
    log.warning("going on without %s: %d chunk(s) move again, %s of them from the store "
                "(this loader reads %s)", loss.member, len(again.plan.chunks),
                human_bytes(again.store_bytes), human_bytes(sum(c.length for c in mine)))
    digests: list[str] = []
    if again.plan.chunks:
        exchange = exchange_of(again.plan, survivors.rank, reader_of(again, survivors.rank))
        try:
            agree(survivors, again.plan.fingerprint)
            digests = exchange.run(survivors)
        finally:
            exchange.abandon()
    try:
        merged = again.merged(held, digests, whole=holding[2])
    except ValueError as exc:
        raise GroupError(f"the survivors' exchange without {loss.member} is incomplete: {exc}",
                         hint="rerun every loader of the group") from exc
    return Survived(digests=merged, group=survivors,
                    without=tuple(r for r in group.ranks if r not in survivors.ranks),
                    read_again=sum(c.length for c in mine))


def _reader_of(tmp_dir: Path, store_read: Reader, fetched: dict[Span, tuple[mmap.mmap, str]],
               ) -> Callable[[Replan, int], Reader]:
    return lambda again, rank: _reader(again, rank, tmp_dir, store_read, fetched)


def _reader(again: Replan, rank: int, tmp_dir: Path, store_read: Reader,
            fetched: dict[Span, tuple[mmap.mmap, str]]) -> Reader:
    """Reads this rank's chunks of the survivors' plan: those it holds from memory (read by
    the first exchange, never sent) or from its tmp dir (written), else from the store."""
    from dlo_loader.sink import EntryChunks

    disk = EntryChunks(tmp_dir, again.plan.files, again.plan.algorithms).read
    spans: dict[int, list[tuple[int, int, mmap.mmap | None]]] = {}
    for number in again.from_disk:
        chunk = again.plan.chunks[number]
        if chunk.owner == rank:
            kept = fetched.get(span_of(chunk))
            spans.setdefault(chunk.file, []).append(
                (chunk.offset, chunk.offset + chunk.length, kept[0] if kept else None))

    def read(file: int, offset: int, into: memoryview) -> int:
        for start, end, buffer in spans.get(file, ()):
            if start <= offset < end:
                if buffer is None:
                    return disk(file, offset, into)
                into[:] = memoryview(buffer)[offset - start:offset - start + len(into)]
                return digest.extend(0, into, again.plan.algorithms[file])
        return store_read(file, offset, into)

    return read
