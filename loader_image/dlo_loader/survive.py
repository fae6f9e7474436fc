"""A fill that goes on without a member its group lost.

Owns the steps after the heartbeat found a member lost mid-exchange: the survivors form a group
again (`regroup`), gather what each holds (the chunks it wrote whole: those it read and never
sent are written first, `Exchange.settle`), re-plan what is still missing (`replan`), and run
that plan's exchange in the survivors' group, each reading what it holds from its own tmp dir
and from the store what no survivor holds. A further loss in that exchange starts the next
generation of survivors the same way, with what each holds by then, until the fill finishes or
one member is left to finish it.
Returns every chunk's digest in the first plan's order, for the usual checks and the commit
(`transfer`). Called by `transfer`. Must not commit, take locks or decide the first plan.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dlo_loader.checks import agree
from dlo_loader.errors import GroupError, MemberLost
from dlo_loader.regroup import survivors_of
from dlo_loader.replan import Replan, replan
from dlo_contract.units import human_bytes

if TYPE_CHECKING:
    from dlo_loader.exchange import Exchange, Reader
    from dlo_loader.members import Loss
    from dlo_loader.plan import Plan
    from dlo_loader.group import Group

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
    """Bytes this rank read again from the store for the lost members."""


@dataclass
class _Holding:
    """What this survivor holds, carried from one generation of survivors to the next: the
    chunks it wrote whole, by first-plan chunk index, and what it read again so far."""

    written: dict[int, str]
    whole: bool
    """Its node's entry holds every chunk (`go_on`)."""
    read_again: int = 0

    def shared(self) -> tuple[dict[int, str], bool]:
        """What the survivors gather from each (`replan`'s inputs)."""
        return self.written, self.whole

    def keep(self, exchange: Exchange, again: Replan) -> None:
        """Take in what a survivors' exchange cut short by a further loss left this one: the
        chunks it wrote, and those it read and never sent (written now, their buffers freed,
        as the first exchange's: `Exchange.settle`)."""
        self.written |= {again.original[i]: d for i, d in exchange.settle().items()}


def go_on(*, plan: Plan, group: Group, loss: Loss, first: Exchange, tmp_dir: Path,
          store_read: Reader, exchange_of: Callable[[Plan, int, Reader], Exchange],
          whole: bool = False, done: list[str] | None = None) -> Survived:
    """Finish the fill of `plan` in a group of the survivors of `group` (see the module
    docstring); `first`: the exchange the loss cut short; `tmp_dir`: where this rank's chunks
    lie (`whole`: its node's entry, which holds every chunk); `store_read`: reads from the store;
    `exchange_of(plan, rank, read)` starts an exchange; `done`: every chunk's digest where the
    loss came once `first` was over (it wrote every chunk). A further loss in the
    survivors' exchange starts the next generation with what each holds then. Raises the
    loss's error where the survivors cannot go on (this member dropped, no other left)."""
    # Its reads stop; the chunks it read and never sent are written to `tmp_dir` and every idle
    # buffer is freed, so the survivors' exchange has the memory budget (`Exchange.settle`).
    settled = first.settle()
    written = {i: d for i, d in enumerate(done) if d} if done is not None else settled
    holding = _Holding(written, whole)
    reader_of = _reader_of(tmp_dir, store_read)
    lost = group
    while True:
        try:
            survivors = survivors_of(lost, loss)
        except BaseException as exc:
            if lost is not group:  # a group of survivors is this fill's to end
                lost.close(exc)
            raise
        try:
            return _finish(plan, survivors, group, loss, holding, reader_of, exchange_of)
        except MemberLost as exc:
            again = survivors.watch.lost()
            if again is None:
                survivors.close(exc)
                raise
            lost, loss = survivors, again
        except BaseException as exc:  # the other survivors name this one and why it left
            survivors.close(exc)
            raise


def _finish(plan: Plan, survivors: Group, group: Group, loss: Loss, holding: _Holding,
            reader_of: Callable[[Replan, int], Reader],
            exchange_of: Callable[[Plan, int, Reader], Exchange]) -> Survived:
    """One generation's re-plan and exchange (see `go_on`); on a further loss, what this
    survivor holds then is in `holding`."""
    shared = holding.shared()
    gathered = survivors.all_gather_object(shared)
    try:
        again = replan(plan, survivors.ranks, [h for h, _ in gathered],
                       [w for _, w in gathered])
    except ValueError as exc:
        raise GroupError(f"the survivors cannot go on without {loss.member}: {exc}",
                         hint="rerun every loader of the group") from exc
    mine = [c for i, c in enumerate(again.plan.chunks) if c.owner == survivors.rank
            and i not in again.from_disk]
    log.warning("going on without %s: %d chunk(s) move again, %s of them from the store "
                "(this loader reads %s)", loss.member, len(again.plan.chunks),
                human_bytes(again.store_bytes), human_bytes(sum(c.length for c in mine)))
    holding.read_again += sum(c.length for c in mine)
    digests: list[str] = []
    if again.plan.chunks:
        exchange = exchange_of(again.plan, survivors.rank, reader_of(again, survivors.rank))
        try:
            agree(survivors, again.plan.fingerprint)
            digests = exchange.run(survivors)
        except MemberLost:
            holding.keep(exchange, again)
            raise
        finally:
            exchange.abandon()
    try:
        merged = again.merged(shared[0], digests, whole=holding.whole)
    except ValueError as exc:
        raise GroupError(f"the survivors' exchange without {loss.member} is incomplete: {exc}",
                         hint="rerun every loader of the group") from exc
    return Survived(digests=merged, group=survivors,
                    without=tuple(r for r in group.ranks if r not in survivors.ranks),
                    read_again=holding.read_again)


def _reader_of(tmp_dir: Path, store_read: Reader) -> Callable[[Replan, int], Reader]:
    return lambda again, rank: _reader(again, rank, tmp_dir, store_read)


def _reader(again: Replan, rank: int, tmp_dir: Path, store_read: Reader) -> Reader:
    """Reads this rank's chunks of the survivors' plan: those it holds from its tmp dir (its
    node's entry, where it holds one), else from the store."""
    from dlo_loader.sink import EntryChunks

    disk = EntryChunks(tmp_dir, again.plan.files, again.plan.algorithms).read
    spans: dict[int, list[tuple[int, int]]] = {}
    for number in again.from_disk:
        chunk = again.plan.chunks[number]
        if chunk.owner == rank:
            spans.setdefault(chunk.file, []).append((chunk.offset, chunk.offset + chunk.length))

    def read(file: int, offset: int, into: memoryview) -> int:
        if any(start <= offset < end for start, end in spans.get(file, ())):
            return disk(file, offset, into)
        return store_read(file, offset, into)

    return read
