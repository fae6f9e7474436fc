"""The check against the store's own checksums, of whole objects and of objects' parts
(COMPOSITE): pure functions over chunk digests, no store."""

from __future__ import annotations

import base64
import os
import zlib

import pytest
from awscrt import checksums
from dlo_loader import digest
from dlo_loader.digest import ChecksumKind, FileDigests, StoreChecksum, chunk_digest
from dlo_loader.errors import SourceError
from dlo_contract.cache import CRC_ALGORITHMS, combine_crc, crc_function

KIB = 1 << 10


def _b64(value: int, width: int) -> str:
    return base64.b64encode(value.to_bytes(width, "big")).decode()


def _store_composite(parts: list[bytes], algorithm: str) -> str:
    """What S3 keeps for a COMPOSITE checksum: the CRC of the parts' CRCs, big-endian."""
    crc = getattr(checksums, algorithm)
    return _b64(crc(b"".join(crc(p).to_bytes(4, "big") for p in parts)), 4)


def _chunked(data: bytes, cut: int, algorithm: str) -> tuple[list[int], list[str]]:
    pieces = [data[o:o + cut] for o in range(0, len(data), cut)]
    return [len(p) for p in pieces], [chunk_digest(p, algorithm) for p in pieces]


@pytest.mark.parametrize("algorithm", CRC_ALGORITHMS)
def test_each_crc_is_the_one_the_store_keeps(algorithm: str) -> None:
    """The loader's CRCs (ISA-L's CRC32, awscrt's others) give what botocore computes for S3
    for the same bytes, whether extended piece by piece or combined from pieces' CRCs."""
    data = os.urandom(3 * KIB * KIB + 5)
    expected = getattr(checksums, algorithm)(data)
    if algorithm == "crc32":
        assert zlib.crc32(data) == expected
    extend, cut = crc_function(algorithm), 1000 * KIB + 3
    assert extend(data[cut:], extend(data[:cut], 0)) == expected
    assert combine_crc(algorithm, extend(data[:cut], 0), extend(data[cut:], 0),
                       len(data) - cut) == expected


@pytest.mark.parametrize(("listed", "checksum_type", "etag", "expected"), [
    (["CRC32"], "COMPOSITE", "9b2c-3", "crc32"), (["CRC32C"], None, "9b2c-3", "crc32c"),
    (["CRC32"], "FULL_OBJECT", "9b2c-3", None), (["CRC32"], None, "9b2c", None),
    (["CRC64NVME"], None, "9b2c-3", None), (["SHA256"], "COMPOSITE", "9b2c-3", None)])
def test_an_object_is_cut_at_its_parts_where_its_store_crc_may_be_of_them(
        listed: list[str], checksum_type: str | None, etag: str, expected: str | None) -> None:
    """A multipart upload's CRC32 or CRC32C, COMPOSITE or not said; never CRC64-NVME (always
    of the whole object) nor a SHA (not a CRC: its parts cannot be combined)."""
    assert digest.of_parts_algorithm(listed, checksum_type,
                                     multipart=digest.is_multipart(etag)) == expected


@pytest.mark.parametrize(("value", "checksum_type", "multipart", "kind", "parts"), [
    ("Sx1yPg==-3", "COMPOSITE", True, ChecksumKind.PARTS, 3),  # real S3
    ("Sx1yPg==-3", None, True, ChecksumKind.PARTS, 3),
    ("Sx1yPg==", "COMPOSITE", True, ChecksumKind.PARTS, None),
    ("Sx1yPg==", None, True, ChecksumKind.UNSTATED, None),  # moto
    ("Sx1yPg==", "FULL_OBJECT", True, ChecksumKind.WHOLE, None),
    ("Sx1yPg==", None, False, ChecksumKind.WHOLE, None)])
def test_the_kind_of_a_store_checksum_from_its_head(
        value: str, checksum_type: str | None, multipart: bool, kind: ChecksumKind,
        parts: int | None) -> None:
    store = digest.store_checksum("crc32", value, checksum_type, multipart=multipart)
    assert (store.algorithm, store.value, store.kind, store.parts) == (
        "crc32", "4b1d723e", kind, parts)


def test_a_crc64nvme_said_to_be_of_parts_is_not_relied_on() -> None:
    store = digest.store_checksum("crc64nvme", "AAAAAAAAAAA=-2", None, multipart=True)
    assert store == StoreChecksum("crc64nvme")


@pytest.mark.parametrize("algorithm", ["crc32", "crc32c"])
@pytest.mark.parametrize(("size", "part", "cut"), [
    (12 * KIB, 5 * KIB, 5 * KIB), (12 * KIB, 5 * KIB, KIB), (10 * KIB, 5 * KIB, 5 * KIB),
    (3 * KIB, 5 * KIB, 5 * KIB)])
def test_the_crc_of_the_parts_crcs_from_chunks_cut_at_the_parts(
        algorithm: str, size: int, part: int, cut: int) -> None:
    data = os.urandom(size)
    parts = [data[o:o + part] for o in range(0, size, part)]
    lengths, digests = _chunked(data, cut, algorithm)
    value, count = digest.composite(lengths, digests, part, algorithm)
    assert count == len(parts)
    assert value == base64.b64decode(_store_composite(parts, algorithm)).hex()
    if size > part:  # chunks across a part boundary cannot give the parts' CRCs
        with pytest.raises(ValueError, match="not cut at parts"):
            digest.composite(*_chunked(data, 3 * KIB, algorithm), part, algorithm)


def _check(file: FileDigests, store: StoreChecksum, holds: bool = True) -> tuple[str, list]:
    asked: list[tuple[str, int]] = []

    def layout_holds(key: str, part_bytes: int) -> bool:
        asked.append((key, part_bytes))
        return holds

    summary = digest.check_store([file], {file.key: store}, "s3://b/p/",
                                 layout_holds=layout_holds).summary
    return summary, asked


def test_an_object_of_parts_is_checked_part_by_part_and_a_damaged_one_fails() -> None:
    data = os.urandom(12 * KIB)
    parts = [data[:5 * KIB], data[5 * KIB:10 * KIB], data[10 * KIB:]]
    lengths, digests = _chunked(data, KIB, "crc32")
    file = FileDigests("m.bin", "crc32", lengths, digests, part_bytes=5 * KIB)
    store = digest.store_checksum("crc32", _store_composite(parts, "crc32") + "-3", "COMPOSITE",
                                  multipart=True)
    assert _check(file, store) == ("all", [])  # the parts are asked about only on a mismatch
    damaged = bytearray(data)
    damaged[7 * KIB] ^= 1
    bad = FileDigests("m.bin", "crc32", *_chunked(bytes(damaged), KIB, "crc32"), 5 * KIB)
    with pytest.raises(SourceError, match="m.bin: the bytes read have crc32 [0-9a-f]{8} of "
                                          "their parts' CRCs, the store publishes"):
        _check(bad, store)
    # The same mismatch where the parts were not as assumed: not checked, not blamed.
    assert _check(bad, store, holds=False) == ("none", [("m.bin", 5 * KIB)])
    # A count of parts other than the store's is a mismatch too.
    four = digest.store_checksum("crc32", _store_composite(parts, "crc32") + "-4", None,
                                 multipart=True)
    with pytest.raises(SourceError, match=r"\(3 parts, the store 4\)"):
        _check(file, four)


def test_an_unstated_kind_matches_either_the_parts_or_the_whole() -> None:
    data = os.urandom(12 * KIB)
    lengths, digests = _chunked(data, 5 * KIB, "crc32c")
    file = FileDigests("m.bin", "crc32c", lengths, digests, part_bytes=5 * KIB)
    whole = digest.store_checksum("crc32c", _b64(checksums.crc32c(data), 4), None,
                                  multipart=True)
    assert whole.kind is ChecksumKind.UNSTATED
    assert _check(file, whole) == ("all", [])
    # Not cut at its parts (the layout was not even): nothing to compare a parts' CRC with.
    uncut = FileDigests("m.bin", "crc32c", lengths, digests)
    parts = digest.store_checksum("crc32c", "AAAAAA==-3", "COMPOSITE", multipart=True)
    assert _check(uncut, parts) == ("none", [])
