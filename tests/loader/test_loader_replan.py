"""The survivors' plan after a member is lost (`replan`): every chunk not held by every
survivor moves once more, from the disk of a survivor that holds it where one does, else from
the store, balanced; the digests of both exchanges come back in the first plan's order."""

from __future__ import annotations

import pytest
from dlo_loader.plan import Plan, build_plan
from dlo_loader.replan import replan
from dlo_contract.cache import ObjectIdentity

MIB = 1 << 20
FILES = [
    ObjectIdentity("transformer/b.safetensors", 37 * MIB + 123, "e2"),
    ObjectIdentity("transformer/a.safetensors", 100 * MIB, "e1"),
    ObjectIdentity("transformer/config.json", 900, "e3"),
]
PLAN = build_plan(FILES, mode="multi-reader", world_size=3, chunk_bytes=4 * MIB)
LOST = 2


def digest(index: int) -> str:
    return f"digest-{index}"


def holding(plan: Plan, rank: int, *, rounds: int) -> dict[int, str]:
    """What `rank` holds after the first `rounds` rounds went round the ring, beside every chunk
    of its own it read."""
    chunks = [c for round_ in plan.rounds[:rounds] for c in round_] + list(plan.owned(rank))
    return {c.index: digest(c.index) for c in chunks}


def test_what_no_survivor_holds_is_read_again_and_what_one_holds_comes_from_its_disk() -> None:
    # Rank 0 wrote three rounds before the loss, rank 1 two (its writes of the third were cut).
    held = [holding(PLAN, 0, rounds=3), holding(PLAN, 1, rounds=2)]
    again = replan(PLAN, [0, 1], held)
    moving = {PLAN.chunks[i] for i in again.original}
    # The lost member's chunks after the third round: no survivor has them.
    unread = {c for c in PLAN.owned(LOST) if c.index not in held[0]}
    assert unread and unread <= moving
    assert again.store_bytes == sum(c.length for c in unread)
    # Everything else that moves is held by a survivor, and that one reads it from its disk.
    for new_index, chunk in enumerate(again.plan.chunks):
        first = PLAN.chunks[again.original[new_index]]
        assert (chunk.file, chunk.offset, chunk.length) == (first.file, first.offset,
                                                            first.length)
        if first in unread:
            assert new_index not in again.from_disk
        else:
            assert new_index in again.from_disk and first.index in held[chunk.owner]
    # Nothing both survivors hold moves; everything else moves exactly once.
    both = set(held[0]) & set(held[1])
    assert {c.index for c in moving} == set(range(len(PLAN.chunks))) - both
    assert again.plan.world_size == 2 and len(set(again.original)) == len(again.original)
    assert again.plan.fingerprint != PLAN.fingerprint


def test_the_lost_members_whole_share_is_balanced_over_the_survivors() -> None:
    """Lost before its first round: each survivor holds its own chunks alone."""
    held = [holding(PLAN, 0, rounds=0), holding(PLAN, 1, rounds=0)]
    again = replan(PLAN, [0, 1], held)
    assert again.store_bytes == PLAN.owned_bytes(LOST)
    read = [sum(c.length for i, c in enumerate(again.plan.chunks)
                if c.owner == k and i not in again.from_disk) for k in (0, 1)]
    assert abs(read[0] - read[1]) <= PLAN.chunk_bytes


def test_the_digests_come_back_in_the_first_plans_order() -> None:
    held = [holding(PLAN, 0, rounds=3), holding(PLAN, 1, rounds=2)]
    again = replan(PLAN, [0, 2], held)
    for mine in held:
        merged = again.merged(mine, [digest(i) for i in again.original])
        assert merged == [digest(i) for i in range(len(PLAN.chunks))]
    with pytest.raises(ValueError, match="have no digest after the re-plan"):
        again.merged({}, [digest(i) for i in again.original])
    rotten = next(iter(again.from_disk))
    read_back = [digest(i) if k != rotten else "rotten" for k, i in enumerate(again.original)]
    with pytest.raises(ValueError, match=rf"chunks \[{again.original[rotten]}\] read back from a "
                                         "survivor's disk differ from what it wrote"):
        again.merged(held[0], read_back)


def test_nothing_moves_when_every_survivor_holds_everything() -> None:
    everything = {c.index: digest(c.index) for c in PLAN.chunks}
    again = replan(PLAN, [0, 1], [everything, everything])
    assert (again.plan.chunks, again.store_bytes, again.plan.rounds) == ((), 0, ())


def test_survivors_that_wrote_one_chunk_differently_are_refused() -> None:
    first = PLAN.chunks[0].index
    held = [{first: "one"}, {first: "another"}]
    with pytest.raises(ValueError, match=f"chunk {first} of file .* was written with 2 "
                                         "different digests by the survivors"):
        replan(PLAN, [0, 1], held)


def test_a_survivor_that_holds_the_entry_serves_every_missing_chunk_from_it() -> None:
    """Survivor 1's node holds the entry (it read and sent two rounds' chunks of its own): it
    serves whatever survivor 0 misses, nothing comes from the store, and its digests are those
    any survivor recorded; a chunk nobody read has none where every survivor holds the entry."""
    received = holding(PLAN, 0, rounds=2)
    sent = {i: d for i, d in received.items() if PLAN.chunks[i].owner == 1}
    again = replan(PLAN, [0, 1], [received, sent], [False, True])
    assert again.store_bytes == 0 and again.from_disk == frozenset(range(len(again.plan.chunks)))
    assert {c.owner for c in again.plan.chunks} == {1}
    assert {again.original[i] for i in range(len(again.plan.chunks))} == \
        {c.index for c in PLAN.chunks} - set(received)
    read = [digest(i) for i in again.original]
    assert again.merged(received, read) == again.merged(sent, read, whole=True) == \
        [digest(i) for i in range(len(PLAN.chunks))]
    both = replan(PLAN, [0, 1], [sent, {}], [True, True])
    assert both.plan.chunks == ()
    assert both.merged({}, [], whole=True) == [sent.get(i, "") for i in range(len(PLAN.chunks))]
