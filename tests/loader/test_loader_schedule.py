"""The fetch order: chunks in the order the exchange consumes them, a few at a time, so that on a
link all of a rank's GETs share the first chunk arrives early whatever `readers` is."""

from __future__ import annotations

import threading
from fractions import Fraction

import pytest
from dlo_loader import digest
from dlo_loader.digest import ALGORITHM, chunk_digest
from dlo_loader.fetch import BufferPool, Fetcher
from dlo_loader.plan import build_plan
from dlo_loader.schedule import FetchOrder, FetchShape, Part, fetch_shape
from dlo_contract.cache import ObjectIdentity

MIB = 1 << 20


@pytest.mark.parametrize(("chunk", "readers", "buffers", "expected"), [
    # Four open chunks of four 4 MiB parts keep 16 GETs in flight.
    (16 * MIB, 16, 62, FetchShape(part_bytes=4 * MIB, open_chunks=4, readers=16)),
    (16 * MIB, 4, 62, FetchShape(part_bytes=4 * MIB, open_chunks=2, readers=4)),
    # Small chunks: halves of 1 MiB, four chunks open, so eight GETs in flight, not sixteen.
    (2 * MIB, 16, 510, FetchShape(part_bytes=1 * MIB, open_chunks=4, readers=8)),
    (2 * MIB, 2, 510, FetchShape(part_bytes=1 * MIB, open_chunks=2, readers=2)),
    (1 * MIB, 16, 510, FetchShape(part_bytes=1 * MIB, open_chunks=4, readers=4)),
    (16 * MIB, 1, 62, FetchShape(part_bytes=16 * MIB, open_chunks=2, readers=1)),
    (16 * MIB, 16, 1, FetchShape(part_bytes=4 * MIB, open_chunks=1, readers=4)),
])
def test_fetch_shape(chunk: int, readers: int, buffers: int, expected: FetchShape) -> None:
    assert fetch_shape(chunk_bytes=chunk, readers=readers, buffers=buffers) == expected


def test_parts_come_chunk_by_chunk_with_a_bounded_number_open() -> None:
    order = FetchOrder([8, 8, 8, 3], part_bytes=4, open_limit=2)
    claimed = [order.claim() for _ in range(5)]
    assert claimed == [Part(0, 0, 4), Part(0, 4, 4), Part(1, 0, 4), Part(1, 4, 4), None]
    assert order.complete(Part(1, 0, 4)) is False
    assert order.claim() is None  # chunks 0 and 1 are still open
    assert order.complete(Part(0, 4, 4)) is False
    assert order.complete(Part(0, 0, 4)) is True
    assert order.claim(can_open=False) is None  # no buffer for chunk 2 yet
    assert [order.claim(), order.claim()] == [Part(2, 0, 4), Part(2, 4, 4)]
    assert order.claim() is None
    assert order.complete(Part(1, 4, 4)) is True
    assert order.claim() == Part(3, 0, 3)
    assert order.all_claimed and order.claim() is None


def shared_link_completions(lengths: list[int], shape: FetchShape) -> dict[int, Fraction]:
    """When each chunk completes if every GET in flight gets an equal share of one link of one
    byte per time unit (what TCP flows through one bottleneck approach)."""
    order = FetchOrder(lengths, part_bytes=shape.part_bytes, open_limit=shape.open_chunks)
    left: dict[Part, Fraction] = {}
    now, done = Fraction(0), {}
    while True:
        while len(left) < shape.readers and (part := order.claim()) is not None:
            left[part] = Fraction(part.length)
        if not left:
            return done
        first = min(left, key=lambda p: (left[p], p.position, p.start))
        progress = left[first]
        now += progress * len(left)
        left = {p: remaining - progress for p, remaining in left.items()}
        for part in sorted((p for p, r in left.items() if r == 0),
                           key=lambda p: (p.position, p.start)):
            del left[part]
            if order.complete(part):
                done[part.position] = now


@pytest.mark.parametrize(("chunk", "readers", "first_after_chunks"), [
    (16 * MIB, 16, 4), (16 * MIB, 4, 1), (2 * MIB, 16, 4), (2 * MIB, 2, 1)])
def test_on_a_shared_link_chunks_complete_in_exchange_order(
    chunk: int, readers: int, first_after_chunks: int
) -> None:
    lengths = [chunk] * 35 + [chunk // 3]
    shape = fetch_shape(chunk_bytes=chunk, readers=readers, buffers=64)
    done = shared_link_completions(lengths, shape)
    assert sorted(done) == list(range(len(lengths)))
    # A chunk is never overtaken by one opened after it left the window of open chunks.
    assert all(done[k] <= done[j] for k in done for j in done if j >= k + shape.open_chunks)
    assert done[0] == first_after_chunks * chunk  # the first round waits for a few chunks only
    assert max(done.values()) == sum(lengths)  # and the link never idles


def test_whole_chunks_all_at_once_would_hold_back_the_first_round() -> None:
    """What the order prevents: `readers` whole chunks started together finish together."""
    lengths = [2 * MIB] * 36
    whole = FetchShape(part_bytes=2 * MIB, open_chunks=16, readers=16)
    assert shared_link_completions(lengths, whole)[0] == 16 * 2 * MIB


def test_fetcher_delivers_every_chunk_in_parts_with_its_digest() -> None:
    files = [ObjectIdentity("a", 10 * MIB + 5, "e"), ObjectIdentity("b", 3 * MIB, "e")]
    content = {0: bytes(range(256)) * (files[0].size // 256) + b"x" * 5,
               1: bytes(reversed(range(256))) * (files[1].size // 256)}
    plan = build_plan(files, mode="multi-reader", world_size=1, chunk_bytes=8 * MIB)
    reads: list[tuple[int, int, int]] = []
    lock = threading.Lock()

    def read(file: int, offset: int, into: memoryview) -> int:
        with lock:
            reads.append((file, offset, len(into)))
        into[:] = content[file][offset:offset + len(into)]
        return digest.extend(0, into, ALGORITHM)

    shape = FetchShape(part_bytes=4 * MIB, open_chunks=2, readers=3)
    stop = threading.Event()
    fetcher = Fetcher(plan.owned(0), read, shape=shape, pool=BufferPool(2, 8 * MIB), stop=stop,
                      algorithms=plan.algorithms)
    try:
        for position, chunk in enumerate(plan.owned(0)):
            assert fetcher.wait_ready(60.0, position)
            taken, buffer, found = fetcher.take(position)
            expected = content[chunk.file][chunk.offset:chunk.offset + chunk.length]
            assert taken == chunk
            assert bytes(memoryview(buffer)[:chunk.length]) == expected
            assert found == chunk_digest(expected, ALGORITHM)
            fetcher.give_back(buffer)
    finally:
        stop.set()
    assert fetcher.error is None
    assert sorted(reads) == [(0, 0, 4 * MIB), (0, 4 * MIB, 4 * MIB), (0, 8 * MIB, 2 * MIB + 5),
                             (1, 0, 3 * MIB)]


@pytest.mark.parametrize(("listed", "checksum_type", "etag", "expected"), [
    (["CRC32"], None, "9b2c", "crc32"), (["CRC32C"], "FULL_OBJECT", "9b2c", "crc32c"),
    (["CRC64NVME"], None, "9b2c", "crc64nvme"), (["CRC32"], "COMPOSITE", "9b2c-3", "crc64nvme"),
    (["CRC32"], None, "9b2c-3", "crc64nvme"), (["CRC32"], "FULL_OBJECT", "9b2c-3", "crc32"),
    (["SHA256"], None, "9b2c", "crc64nvme"), ([], None, "9b2c", "crc64nvme")])
def test_an_objects_chunks_are_hashed_with_the_whole_object_crc_its_listing_names(
        listed: list[str], checksum_type: str | None, etag: str, expected: str) -> None:
    """A multipart object's checksum counts only where the store states FULL_OBJECT."""
    multipart = digest.is_multipart(etag)
    assert digest.algorithm_for(listed, checksum_type, multipart=multipart) == expected


@pytest.mark.parametrize("algorithm", ["crc64nvme", "crc32c", "crc32"])
@pytest.mark.parametrize("cuts", [(), (1,), (4096, 4097), (1, 2, 3, 99_000)])
def test_a_chunk_digest_from_the_running_crcs_of_its_parts_equals_one_pass(
        cuts: tuple[int, ...], algorithm: str) -> None:
    data = bytes(range(256)) * 390 + b"tail"
    bounds = [0, *cuts, len(data)]
    parts = [(hi - lo, digest.extend(digest.extend(0, data[lo:(lo + hi) // 2], algorithm),
                                     data[(lo + hi) // 2:hi], algorithm))
             for lo, hi in zip(bounds, bounds[1:])]
    assert digest.of_parts(parts, algorithm) == chunk_digest(data, algorithm)
    assert digest.of_parts(parts[:-1], algorithm) != chunk_digest(data, algorithm)


def test_fetcher_hands_a_failed_read_to_the_consumer() -> None:
    plan = build_plan([ObjectIdentity("a", 100, "e")], mode="independent", world_size=1,
                      chunk_bytes=64)

    def read(file: int, offset: int, into: memoryview) -> int:
        raise OSError("disk on fire")

    stop = threading.Event()
    shape = FetchShape(part_bytes=64, open_chunks=2, readers=2)
    fetcher = Fetcher(plan.owned(0), read, shape=shape, pool=BufferPool(2, 64), stop=stop,
                      algorithms=plan.algorithms)
    try:
        assert fetcher.wait_ready(60.0)
    finally:
        stop.set()
    assert str(fetcher.error) == "disk on fire"
