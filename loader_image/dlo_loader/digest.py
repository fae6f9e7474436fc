"""Chunk digests of a fill, and the check against the store's own whole-object checksums.

Owns the loader's choice of digest (`ALGORITHM`, named in every manifest record it writes) and
the comparison with what the store publishes. CRC64-NVME runs at several GB/s on one core (SHA-256
at under 2), so hashing no longer bounds a fill; and it is the checksum S3 keeps for whole objects
(`x-amz-checksum-crc64nvme`, type FULL_OBJECT), so the chunk digests the fill computes anyway
combine into the object's CRC without reading a byte again (`combine_crc64nvme`). Called by
`fetch` and `exchange` (one digest per chunk) and by `fill` (the store check before publication).
Must not read the store or files.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from awscrt.checksums import crc64nvme as _crc64nvme

from dlo_contract.cache import combine_crc64nvme, hexdigest

from dlo_loader.errors import SourceError

ALGORITHM = "crc64nvme"
"""The digest of every chunk the loader writes into a manifest."""
STORE_ALGORITHMS = ("crc64nvme",)
"""Whole-object checksums the store may publish that chunk digests combine into. A store that
publishes another one (`crc32c`, or a composite multipart checksum `...-N`) is reported as not
checked: combining those would need a second CRC per chunk."""


def chunk_digest(data: Any) -> str:
    """The digest of one chunk's bytes (a memoryview of its buffer)."""
    return hexdigest(data, ALGORITHM)


def extend(value: int, piece: Any) -> int:
    """The running CRC64-NVME `value` (0 for no bytes yet) extended by `piece`.

    [Note: hashing while reading] A reader hashes each piece right after it lands in the chunk
    buffer (a socket read of up to a few hundred KiB, or 1 MiB from disk), while those bytes are
    still in the CPU's cache; hashing a whole 16 MiB chunk once it is complete reads it back
    from memory at a third of the speed, on the core the readers share with the store's
    client."""
    return _crc64nvme(piece, value)


def combine(value: int, piece: int, length: int) -> int:
    """The running CRC `value` extended by a piece of `length` bytes whose own running CRC (from
    0) is `piece`: what `extend` would give, without the bytes."""
    return combine_crc64nvme(value, piece, length)


def of_parts(parts: Sequence[tuple[int, int]]) -> str:
    """The digest of a chunk from the running CRCs of its parts, `(length, value)` in order
    (`extend`), as `chunk_digest` writes it; no byte is read again."""
    value = 0
    for length, part in parts:
        value = combine(value, part, length)
    return f"{value:016x}"


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


def combined(lengths: Sequence[int], digests: Sequence[str]) -> str:
    """The CRC64-NVME of a whole file from its chunks' (in order)."""
    value = 0
    for length, digest in zip(lengths, digests, strict=True):
        value = combine_crc64nvme(value, int(digest, 16), length)
    return f"{value:016x}"


def check_store(files: Sequence[tuple[str, Sequence[int], Sequence[str]]],
                published: Mapping[str, StoreChecksum], source: str) -> StoreCheck:
    """Compare the combined chunk CRC of every file in `published` (the store was asked for
    those) with the store's checksum; a mismatch is a `SourceError` naming the object (nothing
    is published)."""
    checked = unavailable = 0
    for key, lengths, digests in files:
        store = published.get(key)
        if store is None:
            continue
        if store.algorithm not in STORE_ALGORITHMS or store.value is None:
            unavailable += 1
            continue
        ours = combined(lengths, digests)
        if ours != store.value:
            raise SourceError(
                f"{source}{key}: the bytes read have {store.algorithm} {ours}, the store "
                f"publishes {store.value} for the object; nothing was published",
                hint="the object changed or was corrupted in transit; rerun the fill",
            )
        checked += 1
    return StoreCheck(checked=checked, unavailable=unavailable)
