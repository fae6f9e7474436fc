"""Chunk digests of a fill, and the check against the store's own whole-object checksums.

Owns the loader's choice of digest for each file (`algorithm_for`, named in every manifest
record it writes) and the comparison with what the store publishes. The digests are CRCs: they
run at several GB/s on one core (SHA-256 at under 2), so hashing no longer bounds a fill; and
S3 keeps a CRC of every whole object it stores (type FULL_OBJECT; `crc64nvme` by default,
`crc32` from recent AWS SDKs, `crc32c`), named in its listing, so a file's chunks are hashed with
its object's CRC and their digests combine into the store's figure without reading a byte again
(`dlo_contract.cache.combine_crc`). Called by `fetch`, `stream`, `source`, `sink` and `exchange`
(one digest per chunk) and by `fill` (the store check before publication). Must not read the
store or files.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from awscrt import checksums

from dlo_contract.cache import CRC_ALGORITHMS, combine_crc, crc_hex, hexdigest

from dlo_loader.errors import SourceError

ALGORITHM = "crc64nvme"
"""The digest of a file's chunks when its object's listing names no CRC the loader knows."""
_EXTEND = {name: getattr(checksums, name) for name in CRC_ALGORITHMS}


def algorithm_for(store_algorithms: Iterable[str], checksum_type: str | None, *,
                  multipart: bool) -> str:
    """The digest of an object's chunks from what its listing says of the store's checksum
    (`ChecksumAlgorithm`, `ChecksumType`): that CRC where the store keeps it for the whole
    object, so the check before publication needs no second pass; else `ALGORITHM`.

    [Note: composite checksums] An object uploaded in parts may carry a checksum of its parts'
    checksums (type COMPOSITE), which no combination of chunk CRCs gives; and a store need not
    say which kind it keeps (moto states neither the type nor the `-N` suffix of the value).
    A whole-object checksum is relied on only where it cannot be composite: the object was
    written in one part (its ETag has no `-N`), or the store states FULL_OBJECT."""
    if not full_object(checksum_type, multipart=multipart):
        return ALGORITHM
    named = [name.lower() for name in store_algorithms if name.lower() in CRC_ALGORITHMS]
    return named[0] if named else ALGORITHM


def full_object(checksum_type: str | None, *, multipart: bool) -> bool:
    """Whether a store checksum of this `checksum_type` (None: not stated) is of the whole
    object's bytes (see [Note: composite checksums])."""
    return checksum_type == "FULL_OBJECT" or (checksum_type is None and not multipart)


def is_multipart(etag: str) -> bool:
    """Whether an S3 ETag (quotes dropped) is a multipart upload's: `<hex>-<parts>`."""
    _, dash, parts = etag.rpartition("-")
    return bool(dash) and parts.isdigit()


def chunk_digest(data: Any, algorithm: str) -> str:
    """The digest of one chunk's bytes (a memoryview of its buffer)."""
    return hexdigest(data, algorithm)


def extend(value: int, piece: Any, algorithm: str) -> int:
    """The running CRC `value` (0 for no bytes yet) extended by `piece`.

    [Note: hashing while reading] A reader hashes each piece right after it lands in the chunk
    buffer (a socket read of up to a few hundred KiB, or 1 MiB from disk), while those bytes are
    still in the CPU's cache; hashing a whole 16 MiB chunk once it is complete reads it back
    from memory at a third of the speed, on the core the readers share with the store's
    client."""
    return _EXTEND[algorithm](piece, value)


def combine(value: int, piece: int, length: int, algorithm: str) -> int:
    """The running CRC `value` extended by a piece of `length` bytes whose own running CRC (from
    0) is `piece`: what `extend` would give, without the bytes."""
    return combine_crc(algorithm, value, piece, length)


def of_parts(parts: Sequence[tuple[int, int]], algorithm: str) -> str:
    """The digest of a chunk from the running CRCs of its parts, `(length, value)` in order
    (`extend`), as `chunk_digest` writes it; no byte is read again."""
    value = 0
    for length, part in parts:
        value = combine(value, part, length, algorithm)
    return crc_hex(value, algorithm)


def of_running(value: int, algorithm: str) -> str:
    """The digest of a chunk whose bytes were hashed in one running CRC `value` (`extend`)."""
    return crc_hex(value, algorithm)


@dataclass(frozen=True)
class StoreChecksum:
    """What the store published for one object: `algorithm` and its value (hex, as
    `chunk_digest` writes it), or `algorithm` None when it published nothing usable."""

    algorithm: str | None
    value: str | None = None


@dataclass(frozen=True)
class StoreCheck:
    """How many objects' whole-object checksums were compared, and how many had none usable."""

    checked: int
    unavailable: int

    @property
    def summary(self) -> str:
        """`all`, `some`, or `none`: whether every object's bytes matched the store's own CRC."""
        if self.checked and not self.unavailable:
            return "all"
        return "some" if self.checked else "none"


def combined(lengths: Sequence[int], digests: Sequence[str], algorithm: str) -> str:
    """The CRC of a whole file from its chunks' (in order)."""
    return of_parts([(length, int(digest, 16))
                     for length, digest in zip(lengths, digests, strict=True)], algorithm)


def check_store(files: Sequence[tuple[str, str, Sequence[int], Sequence[str]]],
                published: Mapping[str, StoreChecksum], source: str) -> StoreCheck:
    """Compare the combined chunk CRC of every file `(key, algorithm, lengths, digests)` in
    `published` (the store was asked for those) with the store's checksum; a mismatch is a
    `SourceError` naming the object (nothing is published). A store checksum of another
    algorithm than the file's digest (the listing named none, or not this one) is not checked."""
    checked = unavailable = 0
    for key, algorithm, lengths, digests in files:
        store = published.get(key)
        if store is None:
            continue
        if store.algorithm != algorithm or store.value is None:
            unavailable += 1
            continue
        ours = combined(lengths, digests, algorithm)
        if ours != store.value:
            raise SourceError(
                f"{source}{key}: the bytes read have {store.algorithm} {ours}, the store "
                f"publishes {store.value} for the object; nothing was published",
                hint="the object changed or was corrupted in transit; rerun the fill",
            )
        checked += 1
    return StoreCheck(checked=checked, unavailable=unavailable)
