"""Content digests: one per small file, one per chunk for large files, of a named algorithm.

Owns the hashing rules of format v1 and the algorithms a manifest may name (`ALGORITHMS`):
`sha256` (the first entries; still verified), the CRCs S3 publishes for whole objects
(`crc64nvme`, what the loader writes unless the store names another: ~25x faster than SHA-256
on one core; `crc32c`; `crc32`, what recent AWS SDKs send by default), whose chunk digests
combine into the store's figure without another pass (`combine_crc`), and `xxh3-128`. Large
files carry a list of per-chunk digests so that several writers (loader ranks, reader threads)
can each hash the byte ranges they wrote, in parallel, without a second pass; small files carry
one digest. Called by the loader (per range), by
`publish` (records that arrive without digests) and by `entry` (full verification). Must not
decide validity or touch anything but the file it is given.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

from dlo_contract.cache.manifest import DEFAULT_ALGORITHM, DIGEST_HEX_DIGITS, FileRecord

DEFAULT_CHUNK_BYTES = 16 << 20
"""Matches the loader's default planning unit, so the loader's chunks are the digest chunks."""
CHUNKED_THRESHOLD = DEFAULT_CHUNK_BYTES
"""Files larger than one chunk carry a chunk list; smaller ones a single SHA-256."""
_READ_BYTES = 4 << 20
HASH_WORKERS = min(8, os.cpu_count() or 1)
"""Threads for hashing; sha256 runs near memory speed, so a few cores suffice."""


class _Hasher(Protocol):
    def update(self, data: Any, /) -> None: ...
    def hexdigest(self) -> str: ...


def crc_function(algorithm: str) -> Callable[[Any, int], int]:
    """`extend(data, value)`: the running CRC `value` (0 for no bytes yet) of one of
    `CRC_ALGORITHMS` extended by `data`. awscrt's (what botocore uses for S3's checksums), but
    CRC32 from ISA-L: awscrt's runs at about a fifth of its CRC64-NVME's speed here, ISA-L's
    at the same speed, and recent AWS SDKs send CRC32 by default, so most objects' chunks are
    hashed with it. Same values; `combine_crc` combines either's."""
    if algorithm == "crc32":
        from isal import isal_zlib

        return isal_zlib.crc32
    from awscrt import checksums

    return getattr(checksums, algorithm)


class _Crc:
    """A CRC (`crc_function`) as a hasher."""

    def __init__(self, algorithm: str) -> None:
        self._algorithm = algorithm
        self._crc, self._value = crc_function(algorithm), 0

    def update(self, data: Any, /) -> None:
        self._value = self._crc(data, self._value)

    def hexdigest(self) -> str:
        return crc_hex(self._value, self._algorithm)


def crc_hex(value: int, algorithm: str) -> str:
    """A CRC's value as a manifest writes its digest (fixed-width lowercase hex)."""
    return f"{value:0{DIGEST_HEX_DIGITS[algorithm]}x}"


CRC_ALGORITHMS = ("crc64nvme", "crc32c", "crc32")
"""The digests that are CRCs: S3 publishes each of them for whole objects, and a file's CRC
combines from its chunks' (`combine_crc`)."""


def _xxh3_128() -> _Hasher:
    import xxhash

    return xxhash.xxh3_128()


ALGORITHMS: dict[str, Callable[[], _Hasher]] = {
    "sha256": hashlib.sha256, "xxh3-128": _xxh3_128,
    **{name: functools.partial(_Crc, name) for name in CRC_ALGORITHMS},
}
assert set(ALGORITHMS) == set(DIGEST_HEX_DIGITS)


def hexdigest(data: Any, algorithm: str = DEFAULT_ALGORITHM) -> str:
    """The digest of one buffer (bytes, memoryview, mmap)."""
    hasher = ALGORITHMS[algorithm]()
    hasher.update(data)
    return hasher.hexdigest()


def combine_crc(algorithm: str, first: int, second: int, second_length: int) -> int:
    """The CRC (one of `CRC_ALGORITHMS`) of A || B from the CRCs of A and B (no pass over the
    bytes)."""
    from awscrt import checksums

    return getattr(checksums, f"combine_{algorithm}")(first, second, second_length)


def _hash_range(fd: int, offset: int, length: int,
                algorithm: str = DEFAULT_ALGORITHM) -> tuple[str, int]:
    """Digest of `length` bytes at `offset` (fewer at end of file); returns (hex, bytes read)."""
    digest = ALGORITHMS[algorithm]()
    done = 0
    while done < length:
        piece = os.pread(fd, min(_READ_BYTES, length - done), offset + done)
        if not piece:
            break
        digest.update(piece)
        done += len(piece)
    return digest.hexdigest(), done


def chunk_count(size: int, chunk_bytes: int) -> int:
    return -(-size // chunk_bytes)


def chunk_digests(
    path: str | os.PathLike[str],
    chunk_bytes: int,
    start_chunk: int = 0,
    stop_chunk: int | None = None,
    algorithm: str = DEFAULT_ALGORITHM,
) -> list[str]:
    """Digests of chunks `[start_chunk, stop_chunk)` of `path` (to the end when stop is None).

    The last chunk of a file may be short; a range past the end yields fewer digests.
    """
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        stop = chunk_count(size, chunk_bytes) if stop_chunk is None else stop_chunk
        stop = min(stop, chunk_count(size, chunk_bytes))
        return [_hash_range(fd, i * chunk_bytes, chunk_bytes, algorithm)[0]
                for i in range(start_chunk, stop)]
    finally:
        os.close(fd)


def sha256_file(path: str | os.PathLike[str]) -> str:
    """SHA-256 of the whole file."""
    return file_digest(path, "sha256")


def file_digest(path: str | os.PathLike[str], algorithm: str = DEFAULT_ALGORITHM) -> str:
    """Digest of the whole file."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return _hash_range(fd, 0, os.fstat(fd).st_size, algorithm)[0]
    finally:
        os.close(fd)


def parallel_chunk_digests(
    path: str | os.PathLike[str], chunk_bytes: int, workers: int = HASH_WORKERS
) -> list[str]:
    """All chunk digests of a file, hashed on `workers` threads (hashlib releases the GIL)."""
    count = chunk_count(os.stat(path).st_size, chunk_bytes)
    with ThreadPoolExecutor(max_workers=max(1, min(workers, count))) as pool:
        parts = pool.map(lambda i: chunk_digests(path, chunk_bytes, i, i + 1), range(count))
        return [digest for part in parts for digest in part]


def file_record(
    path: str | os.PathLike[str], name: str, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> FileRecord:
    """Hash one finished file into its manifest record (chunk list when larger than a chunk)."""
    size = Path(path).stat().st_size
    if size > chunk_bytes:
        return FileRecord(
            name=name, size=size, chunk_bytes=chunk_bytes,
            chunk_digests=tuple(parallel_chunk_digests(path, chunk_bytes)),
        )
    return FileRecord(name=name, size=size, digest=sha256_file(path))
