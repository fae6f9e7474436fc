"""What the survivors of a lost member still have to move, and who reads each piece of it.

Owns a pure function of the first plan, the survivors (by their rank in the group every member
formed) and the chunks each survivor holds written in its publication's tmp dir, digest known
(see [Note: re-planning]). Every survivor computes it from the same inputs (gathered in the
survivors' group, `regroup`), so, like `plan.build_plan`, it needs no agreement beyond the
plan's fingerprint. Called once a group of survivors formed. Must not do I/O.

[Note: re-planning] A survivor keeps every chunk it has written (its own reads and what it
received before the loss). A chunk every survivor holds is done. Any other chunk, whether the
lost member's unread ones, ones it alone had received, or ones a survivor missed because the
round that carried them was cut short, goes round the survivors' ring once more: read by a
survivor that holds it (from its disk: the least loaded of its holders, its digest checked
against the one it recorded), or, where no survivor holds it, from the store by the least loaded survivor.
Only those are `store_bytes`: what the loss costs the store. A survivor whose node holds the
entry already (`whole`: it joined the group to serve its ranges) holds every chunk on disk, its
entry, whatever it read or received: it serves any chunk from there, publishes nothing, and
takes each chunk's digest from whichever survivor recorded it (`known`); a member that held the
entry and was lost is one holder fewer, its unsent chunks served by another holder or the
store. The survivors' plan (`Replan.plan`)
cuts nothing anew: its chunks are the first plan's, renumbered in order, their owners ranks of
the survivors' group; `Replan.original` maps them back, and `merged` puts the digests of both
exchanges in the first plan's order, for the checks and the commit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from dlo_loader.plan import Chunk, Plan


@dataclass(frozen=True)
class Replan:
    plan: Plan
    """The survivors' exchange: the chunks not every survivor holds, owners by rank in the
    survivors' group."""
    original: tuple[int, ...]
    """Each of `plan`'s chunks' index in the first plan."""
    from_disk: frozenset[int]
    """`plan`'s chunks their owner reads from its own tmp dir (it holds them already)."""
    store_bytes: int
    """Bytes read again from the store: the chunks no survivor holds."""
    chunk_count: int
    """How many chunks the first plan has."""
    written: Mapping[int, str]
    """The digest each of `from_disk` was written with: what reading it back must give (where a
    survivor recorded one: a chunk served from an entry nobody read has none)."""
    known: Mapping[int, str]
    """Every digest any survivor recorded, by first-plan index (the survivors agree on each)."""

    def merged(self, held: Mapping[int, str], again: Sequence[str], *,
               whole: bool = False) -> list[str]:
        """Every chunk's digest in the first plan's order: from `held` (what this survivor
        holds: first-plan index to digest; `whole`: it holds the entry, so every digest any
        survivor recorded, `known`) and `again` (the survivors' exchange's, by its index,
        which wins); raises ValueError where one is missing (the inputs disagree). Where every
        survivor holds the entry, a chunk none of them read has no digest: "" (none publishes)."""
        changed = [i for i, digest in self.written.items() if again[i] != digest]
        if changed:
            raise ValueError(f"chunks {[self.original[i] for i in changed][:8]} read back from "
                             "a survivor's disk differ from what it wrote")
        digests = {**(self.known if whole else held), **dict(zip(self.original, again,
                                                                 strict=True))}
        if whole:
            return [digests.get(i, "") for i in range(self.chunk_count)]
        missing = [i for i in range(self.chunk_count) if i not in digests]
        if missing:
            raise ValueError(f"chunks {missing[:8]} have no digest after the re-plan")
        return [digests[i] for i in range(self.chunk_count)]


def replan(plan: Plan, survivors: Sequence[int], held: Sequence[Mapping[int, str]],
           whole: Sequence[bool] = ()) -> Replan:
    """The survivors' plan (see [Note: re-planning]): `survivors` by their rank in the group
    every member formed, in their order in the survivors' group; `held[k]`: what survivor `k`
    holds written, first-plan chunk index to digest; `whole[k]`: survivor `k`'s node holds the entry (every chunk, on disk).
    Raises ValueError where two survivors hold one chunk with different digests (the store's
    object changed under the fill)."""
    if len(held) != len(survivors) or not survivors:
        raise ValueError(f"{len(held)} holdings for {len(survivors)} survivors")
    every = range(len(plan.chunks))
    entries = list(whole) or [False] * len(held)
    written = [set(every) if entry else set(h) for h, entry in zip(held, entries, strict=True)]
    known = {i: d for holding in held for i, d in holding.items()}
    everywhere = set(every).intersection(*written)
    load, count = [0] * len(survivors), [0] * len(survivors)
    owners: dict[int, int] = {}
    from_disk: set[int] = set()
    # Longest first, each to the least-loaded survivor that can serve it (as `plan._balance`).
    for chunk in sorted(plan.chunks, key=lambda c: (-c.length, c.index)):
        _same_digest(chunk, [k for k, holding in enumerate(held) if chunk.index in holding],
                     held)
        holders = [k for k in range(len(held)) if chunk.index in written[k]]
        if chunk.index in everywhere:
            continue
        owner = min(holders or range(len(survivors)), key=lambda k: (load[k], count[k], k))
        owners[chunk.index] = owner
        load[owner] += chunk.length
        count[owner] += 1
        if holders:
            from_disk.add(chunk.index)
    moving = [c for c in plan.chunks if c.index in owners]
    chunks = tuple(replace(c, index=i, owner=owners[c.index]) for i, c in enumerate(moving))
    return Replan(
        plan=replace(plan, world_size=len(survivors), chunks=chunks),
        original=tuple(c.index for c in moving),
        from_disk=frozenset(i for i, c in enumerate(moving) if c.index in from_disk),
        store_bytes=sum(c.length for c in moving if c.index not in from_disk),
        chunk_count=len(plan.chunks),
        written={i: known[c.index] for i, c in enumerate(moving)
                 if c.index in from_disk and c.index in known},
        known=known)


def _same_digest(chunk: Chunk, holders: list[int], held: Sequence[Mapping[int, str]]) -> None:
    digests = {held[k][chunk.index] for k in holders}
    if len(digests) > 1:
        raise ValueError(f"chunk {chunk.index} of file {chunk.file} at offset {chunk.offset} was "
                         f"written with {len(digests)} different digests by the survivors")
