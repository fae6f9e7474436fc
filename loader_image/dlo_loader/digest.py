"""Chunk digests of a fill, and the check against the store's own checksums (of whole
objects, or of their parts).

Owns the loader's choice of digest for each file (`algorithm_for`, named in every manifest
record it writes) and the comparison with what the store publishes. The digests are CRCs: they
run at several GB/s on one core (SHA-256 at under 2), so hashing no longer bounds a fill; and
S3 keeps a CRC of every whole object it stores (type FULL_OBJECT; `crc64nvme` by default,
`crc32` from recent AWS SDKs, `crc32c`), named in its listing (or answered to a HEAD where a
store does not list it: [Note: unlisted checksums] in `source_listing`), so a file's chunks are hashed
with its object's CRC and their digests combine into the store's figure without reading a byte
again (`dlo_contract.cache.combine_crc`); an object uploaded in parts whose CRC32 or CRC32C is
of its parts' CRCs (COMPOSITE) is cut into chunks at its part boundaries, so the same holds
part by part (`composite`). Called by `fetch`, `stream`, `source`, `sink` and `exchange`
(one digest per chunk) and by `fill` (the store check before publication). Must not read the
store; it reads a file only to hash it whole where the store's checksum is such a hash
(`FILE_HASHES`: no CRC of chunks combines into it).
"""

from __future__ import annotations

import base64
import enum
import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlo_contract.cache import CRC_ALGORITHMS, combine_crc, crc_function, crc_hex, hexdigest
from dlo_contract.cache.manifest import DIGEST_HEX_DIGITS

from dlo_loader.errors import SourceError

ALGORITHM = "crc64nvme"
"""The digest of a file's chunks when the store names no CRC the loader knows for its object
(in its listing, or to a HEAD)."""
_EXTEND = {name: crc_function(name) for name in CRC_ALGORITHMS}
FILE_HASHES = ("sha256", "md5", "git-sha1")
"""Store checksums of a whole object that no chunk CRC combines into (the Hub's LFS sha256 and
git blob ids, a listing file's sha256, Azure's Content-MD5): checked against the file as
written, read back once before publication (`file_hash`)."""
_HASH_PIECE_BYTES = 8 << 20
_HASH_THREADS = 4
_PART_CRCS = ("crc32c", "crc32")
"""The CRCs a store may keep of an object's parts (COMPOSITE); CRC64-NVME is always of the whole
object."""


def algorithm_for(store_algorithms: Iterable[str], checksum_type: str | None, *,
                  multipart: bool) -> str:
    """The digest of an object's chunks from what its listing says of the store's checksum
    (`ChecksumAlgorithm`, `ChecksumType`): that CRC where the store keeps it for the whole
    object, so the check before publication needs no second pass; else `ALGORITHM`.

    [Note: composite checksums] An object uploaded in parts may carry a checksum of its parts'
    checksums (type COMPOSITE), which chunk CRCs give only where chunks are cut at the parts;
    and a store need not say which kind it keeps (moto states neither the type nor the `-N`
    suffix of the value). A whole-object checksum is relied on only where it cannot be
    composite: the object was written in one part (its ETag has no `-N`), or the store states
    FULL_OBJECT. A COMPOSITE CRC32 or CRC32C (S3's default for multipart uploads with those,
    what boto3's `upload_file` makes by default of every file over 8 MiB) is checked part by
    part instead: the object is cut into chunks at its part boundaries
    (`plan.chunk_bytes_for_parts`, from its first part's size and part count, one HEAD before
    the plan), each part's CRC is combined from its chunks', and the CRC of the parts' CRCs
    (big-endian, in order) is the store's value (`composite`). The layout is assumed even (every
    part but the last of the first one's size, as SDKs upload); a value that does not match is
    blamed on the bytes only once every part's size has been read and found as assumed
    (`check_store`'s `layout_holds`)."""
    if not full_object(checksum_type, multipart=multipart):
        return ALGORITHM
    return _first_named(store_algorithms, CRC_ALGORITHMS) or ALGORITHM


def full_object(checksum_type: str | None, *, multipart: bool) -> bool:
    """Whether a store checksum of this `checksum_type` (None: not stated) is of the whole
    object's bytes (see [Note: composite checksums])."""
    return checksum_type == "FULL_OBJECT" or (checksum_type is None and not multipart)


def of_parts_algorithm(store_algorithms: Iterable[str], checksum_type: str | None, *,
                       multipart: bool) -> str | None:
    """The CRC of an object's store checksum where it may be of the object's parts (a multipart
    upload's CRC32 or CRC32C, type COMPOSITE or not stated), else None: such an object is cut
    at its parts and its chunks hashed with that CRC (see [Note: composite checksums])."""
    if not multipart or checksum_type not in (None, "COMPOSITE"):
        return None
    return _first_named(store_algorithms, _PART_CRCS)


def _first_named(store_algorithms: Iterable[str], known: Sequence[str]) -> str | None:
    """The first of the listing's checksum algorithms that is one of `known`, lower-case."""
    return next((n.lower() for n in store_algorithms if n.lower() in known), None)


def part_count(etag: str) -> int | None:
    """How many parts an S3 ETag (quotes dropped) says the object was uploaded in
    (`<hex>-<parts>`), or None for an object written in one part."""
    _, dash, parts = etag.rpartition("-")
    return int(parts) if dash and parts.isdigit() else None


def is_multipart(etag: str) -> bool:
    """Whether an S3 ETag (quotes dropped) is a multipart upload's."""
    return part_count(etag) is not None


def chunk_digest(data: Any, algorithm: str) -> str:
    """The digest of one chunk's bytes (a memoryview of its buffer)."""
    return hexdigest(data, algorithm)


def extend(value: int, piece: Any, algorithm: str) -> int:
    """The running CRC `value` (0 for no bytes yet) extended by `piece`.

    [Note: hashing while reading] A reader hashes each piece right after it lands in the chunk
    buffer (a socket read of up to 2 MiB, see [Note: read size] in `source_body`, or 1 MiB from
    disk), while those bytes are still in the CPU's cache; hashing a whole 16 MiB chunk once it
    is complete reads it back from memory at a third of the speed, on the core the readers
    share with the store's client."""
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


class ChecksumKind(enum.Enum):
    """Of what bytes a store checksum is."""

    WHOLE = "whole"
    """The object's bytes (FULL_OBJECT, or an object written in one part)."""
    PARTS = "parts"
    """The object's parts' checksums (COMPOSITE, or a value with the `-N` suffix)."""
    UNSTATED = "unstated"
    """A multipart object's, the store saying neither (moto): either of the two may match."""


@dataclass(frozen=True)
class StoreChecksum:
    """What the store published for one object: `algorithm` and its value (hex, as
    `chunk_digest` writes it), or `algorithm` None when it published nothing usable."""

    algorithm: str | None
    value: str | None = None
    kind: ChecksumKind = ChecksumKind.WHOLE
    parts: int | None = None
    """For `PARTS`: how many parts the value says it is of (its `-N` suffix), if it says."""


def store_checksum(algorithm: str, value: str, checksum_type: str | None, *,
                   multipart: bool) -> StoreChecksum:
    """The store's checksum of an object from its HEAD: `algorithm` (one of the CRCs), `value`
    as S3 sends it (base64, `-N` appended for a composite one), `checksum_type` as stated."""
    encoded, dash, count = value.partition("-")
    if dash or checksum_type == "COMPOSITE":
        kind = ChecksumKind.PARTS
    elif full_object(checksum_type, multipart=multipart):
        kind = ChecksumKind.WHOLE
    else:
        kind = ChecksumKind.UNSTATED
    if kind is not ChecksumKind.WHOLE and algorithm not in _PART_CRCS:
        return StoreChecksum(algorithm)  # no CRC64-NVME is of parts: nothing to rely on
    return StoreChecksum(algorithm, base64.b64decode(encoded).hex(), kind,
                         int(count) if count.isdigit() else None)


@dataclass(frozen=True)
class StoreCheck:
    """How many objects' store checksums were compared, and how many had none usable."""

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


def composite(lengths: Sequence[int], digests: Sequence[str], part_bytes: int,
              algorithm: str) -> tuple[str, int]:
    """The CRC of a file's parts' CRCs (each `part_bytes`, the last what is left), from its
    chunks' (cut at the part boundaries), as a store keeps it for a COMPOSITE checksum; and
    how many parts."""
    part_crcs, running, filled = bytearray(), 0, 0
    width = DIGEST_HEX_DIGITS[algorithm] // 2
    for index, (length, digest) in enumerate(zip(lengths, digests, strict=True)):
        running = combine(running, int(digest, 16), length, algorithm)
        filled += length
        if filled == part_bytes or index == len(lengths) - 1:
            part_crcs += running.to_bytes(width, "big")
            running = filled = 0
        elif filled > part_bytes:
            raise ValueError(f"chunks are not cut at parts of {part_bytes} bytes")
    return chunk_digest(bytes(part_crcs), algorithm), len(part_crcs) // width


@dataclass(frozen=True)
class FileDigests:
    """One file of a fill, as the store check needs it."""

    key: str
    algorithm: str
    lengths: Sequence[int]
    digests: Sequence[str]
    part_bytes: int | None = None
    """Where the plan cut the file at its upload's parts, their size (else None)."""


def file_hasher(algorithm: str, size: int) -> Any:
    """A fresh hasher of `algorithm` (one of `FILE_HASHES`) for a file of `size` bytes."""
    if algorithm == "git-sha1":  # a git blob's id: SHA-1 of a header and the bytes
        return hashlib.sha1(b"blob %d\0" % size)
    return hashlib.new(algorithm)


def file_hash(path: Path, algorithm: str) -> str:
    """The `algorithm` (one of `FILE_HASHES`) of a written file, read in pieces."""
    hasher = file_hasher(algorithm, path.stat().st_size)
    piece = memoryview(bytearray(_HASH_PIECE_BYTES))
    with open(path, "rb", buffering=0) as handle:
        while count := handle.readinto(piece):
            hasher.update(piece[:count])  # hashlib lets go of the GIL for large pieces
    return hasher.hexdigest()


def check_store(files: Sequence[FileDigests], published: Mapping[str, StoreChecksum],
                source: str, *, layout_holds: Callable[[str, int], bool],
                hash_file: Callable[[str, str], str] | None = None) -> StoreCheck:
    """Compare every file's CRC in `published` (the store was asked for those), combined from
    its chunk digests, with the store's checksum of it; a mismatch is a `SourceError` naming
    the object (nothing is published). A store checksum of another algorithm than the file's
    digest (the listing named none, or not this one), or of parts the file was not cut at, is
    not checked. Of parts, a mismatch counts only where `layout_holds(key, part_bytes)`: every
    part of the object has the size assumed (the store is asked only then). A whole-file hash
    (`FILE_HASHES`) is `hash_file(key, algorithm)`'s of the written file, files at once."""
    checked = unavailable = 0
    hashed = _hashed(files, published, hash_file)
    for file in files:
        store = published.get(file.key)
        if store is None:
            continue
        ours = hashed.get(file.key) or _ours(file, store)
        if ours is None:
            unavailable += 1
            continue
        if store.value not in ours:
            if store.kind is not ChecksumKind.WHOLE and not layout_holds(
                    file.key, file.part_bytes or 0):
                unavailable += 1
                continue
            of = "" if store.kind is ChecksumKind.WHOLE else " of their parts' CRCs"
            raise SourceError(
                f"{source}{file.key}: the bytes read have {store.algorithm} {ours[0]}{of}, the "
                f"store publishes {store.value} for the object; nothing was published",
                hint="the object changed or was corrupted in transit; rerun the fill",
            )
        checked += 1
    return StoreCheck(checked=checked, unavailable=unavailable)


def _hashed(files: Sequence[FileDigests], published: Mapping[str, StoreChecksum],
            hash_file: Callable[[str, str], str] | None) -> dict[str, tuple[str, ...]]:
    """By key, the whole-file hash of each file whose store checksum is one (`FILE_HASHES`),
    computed on a few threads at once (each file is read once, from the page cache or disk)."""
    wanted = [(file.key, store.algorithm) for file in files
              if (store := published.get(file.key)) is not None and store.value is not None
              and store.algorithm in FILE_HASHES]
    if not wanted or hash_file is None:
        return {}
    with ThreadPoolExecutor(max_workers=min(len(wanted), _HASH_THREADS),
                            thread_name_prefix="dlo-file-hash") as pool:
        values = pool.map(lambda item: hash_file(*item), wanted)
        return {key: (value,) for (key, _), value in zip(wanted, values)}


def _ours(file: FileDigests, store: StoreChecksum) -> tuple[str, ...] | None:
    """The values of this file's bytes the store's checksum may be (the first named in an
    error), or None when they cannot be compared."""
    if store.algorithm != file.algorithm or store.value is None:
        return None
    if store.kind is ChecksumKind.WHOLE:
        return (combined(file.lengths, file.digests, file.algorithm),)
    if file.part_bytes is None:
        return None
    parts, count = composite(file.lengths, file.digests, file.part_bytes, file.algorithm)
    if store.parts not in (None, count):  # cut at other parts than the store's
        return (f"{parts} ({count} parts, the store {store.parts})",)
    if store.kind is ChecksumKind.PARTS:
        return (parts,)
    return parts, combined(file.lengths, file.digests, file.algorithm)
