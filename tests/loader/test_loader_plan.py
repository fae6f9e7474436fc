"""The transfer plan: every byte exactly once, balanced by bytes, identical on every rank."""

from __future__ import annotations

import pytest
from dlo_loader.plan import Plan, build_plan, chunk_bytes_for_parts
from dlo_contract.cache import ObjectIdentity

MIB = 1 << 20
FILES = [
    ObjectIdentity("transformer/b.safetensors", 37 * MIB + 123, "e2"),
    ObjectIdentity("transformer/a.safetensors", 100 * MIB, "e1"),
    ObjectIdentity("transformer/config.json", 900, "e3"),
    ObjectIdentity("empty.json", 0, "e4"),
]


def covered(plan: Plan) -> dict[str, list[tuple[int, int]]]:
    ranges: dict[str, list[tuple[int, int]]] = {}
    for chunk in plan.chunks:
        ranges.setdefault(plan.files[chunk.file].key, []).append((chunk.offset, chunk.length))
    return ranges


@pytest.mark.parametrize("mode", ["multi-reader", "single-reader", "independent"])
@pytest.mark.parametrize("world", [1, 2, 3, 7])
def test_every_byte_once_in_manifest_chunks(mode: str, world: int) -> None:
    plan = build_plan(FILES, mode=mode, world_size=world, chunk_bytes=16 * MIB)
    for obj in plan.files:
        ranges = covered(plan).get(obj.key, [])
        assert [offset for offset, _ in ranges] == list(range(0, obj.size, 16 * MIB))
        assert sum(length for _, length in ranges) == obj.size
    assert [c.index for c in plan.chunks] == list(range(len(plan.chunks)))
    numbers = [(c.file, c.number) for c in plan.chunks]
    assert numbers == sorted(numbers)
    assert sorted(c.index for rnd in plan.rounds for c in rnd) == list(range(len(plan.chunks)))


@pytest.mark.parametrize("world", [2, 3, 5])
def test_multi_reader_balances_bytes_within_one_chunk(world: int) -> None:
    plan = build_plan(FILES, mode="multi-reader", world_size=world, chunk_bytes=4 * MIB)
    loads = [plan.owned_bytes(rank) for rank in range(world)]
    assert sum(loads) == plan.total_bytes
    assert max(loads) - min(loads) <= 4 * MIB
    assert all(load > 0 for load in loads)


def test_large_file_is_split_across_ranks() -> None:
    plan = build_plan(FILES, mode="multi-reader", world_size=3, chunk_bytes=16 * MIB)
    owners = {c.owner for c in plan.chunks if plan.files[c.file].key == "transformer/a.safetensors"}
    assert owners == {0, 1, 2}


def test_single_reader_gives_rank_zero_everything() -> None:
    plan = build_plan(FILES, mode="single-reader", world_size=3, chunk_bytes=16 * MIB)
    assert plan.owned_bytes(0) == plan.total_bytes
    assert plan.owned(1) == plan.owned(2) == ()
    assert all(len(rnd) == 1 for rnd in plan.rounds)


def test_independent_is_a_group_of_one() -> None:
    plan = build_plan(FILES, mode="independent", world_size=3, chunk_bytes=16 * MIB)
    assert plan.world_size == 1
    assert plan.owned_bytes(0) == plan.total_bytes


def test_rounds_take_one_chunk_per_rank_in_rank_order() -> None:
    plan = build_plan(FILES, mode="multi-reader", world_size=3, chunk_bytes=16 * MIB)
    for number, chunks in enumerate(plan.rounds):
        assert [c.owner for c in chunks] == sorted({c.owner for c in chunks})
        for chunk in chunks:
            assert plan.owned(chunk.owner)[number] == chunk


def test_plan_ignores_listing_order_and_fingerprints_what_matters() -> None:
    one = build_plan(FILES, mode="multi-reader", world_size=3, chunk_bytes=16 * MIB)
    other = build_plan(list(reversed(FILES)), mode="multi-reader", world_size=3,
                       chunk_bytes=16 * MIB)
    assert one == other
    assert one.fingerprint == other.fingerprint
    changed = [ObjectIdentity(f.key, f.size, "changed" + f.etag) for f in FILES]
    assert build_plan(changed, mode="multi-reader", world_size=3,
                      chunk_bytes=16 * MIB).fingerprint != one.fingerprint
    assert build_plan(FILES, mode="multi-reader", world_size=3,
                      chunk_bytes=8 * MIB).fingerprint != one.fingerprint


@pytest.mark.parametrize(("part", "chunk", "expected"), [
    (8 * MIB, 16 * MIB, 8 * MIB),  # boto3's and the AWS CLI's parts: one chunk each
    (16 * MIB, 16 * MIB, 16 * MIB),
    (100 * MIB, 16 * MIB, 12800 * 1024),  # eight chunks of 12.5 MiB
    (5 * MIB, MIB, MIB),
    (17 * MIB, 16 * MIB, 17 * MIB // 2),
    (7 * 748_983, MIB, 748_983),  # no divisor at 6; the next count that divides
    (2 * 1_000_003, 1000, None),  # a prime half: no chunk near the size that fits
])
def test_an_object_of_parts_is_cut_at_every_part_boundary(
        part: int, chunk: int, expected: int | None) -> None:
    assert chunk_bytes_for_parts(part, chunk) == expected


def test_a_plan_cuts_an_object_at_its_parts_and_fingerprints_them() -> None:
    parts = {"transformer/a.safetensors": 40 * MIB}  # 100 MiB: parts of 40, 40 and 20
    plan = build_plan(FILES, mode="multi-reader", world_size=3, chunk_bytes=16 * MIB,
                      part_bytes=parts)
    index = [f.key for f in plan.files].index("transformer/a.safetensors")
    assert plan.file_chunk_bytes[index] == 10 * MIB  # 40 MiB has no third, a quarter fits
    assert covered(plan)["transformer/a.safetensors"] == [(o, 10 * MIB)
                                                          for o in range(0, 100 * MIB, 10 * MIB)]
    assert plan.part_bytes[index] == 40 * MIB
    assert [c for i, c in enumerate(plan.file_chunk_bytes) if i != index] == [16 * MIB] * 3
    assert covered(plan)["transformer/b.safetensors"][1] == (16 * MIB, 16 * MIB)
    plain = build_plan(FILES, mode="multi-reader", world_size=3, chunk_bytes=16 * MIB)
    assert plain.fingerprint != plan.fingerprint
    assert plain.part_bytes == (None,) * len(FILES)
    odd = build_plan(FILES, mode="multi-reader", world_size=3, chunk_bytes=1000,
                     part_bytes={"transformer/config.json": 2 * 1_000_003})
    assert odd.part_bytes == (None,) * len(FILES)  # not cut at its parts: not checked so


def test_each_rank_reads_longest_first_so_the_last_round_moves_short_chunks() -> None:
    # Four files of five whole chunks and a short one: every rank holds one short chunk.
    files = [ObjectIdentity(f"transformer/{i}.safetensors", 10 * MIB + (i + 1) * 64 * 1024,
                            f"e{i}") for i in range(4)]
    plan = build_plan(files, mode="multi-reader", world_size=4, chunk_bytes=2 * MIB)
    for rank in range(4):
        owned = plan.owned(rank)
        assert [c.length for c in owned] == sorted((c.length for c in owned), reverse=True)
        whole = [c.index for c in owned if c.length == 2 * MIB]
        assert whole == sorted(whole)  # file order among equal lengths
    assert len(plan.rounds[-1]) == 4
    assert max(c.length for c in plan.rounds[-1]) == 4 * 64 * 1024
    alone = build_plan(files, mode="independent", world_size=4, chunk_bytes=2 * MIB)
    assert alone.owned(0) == alone.chunks  # no rounds to shorten: file order
