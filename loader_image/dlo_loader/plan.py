"""The transfer plan: which rank reads which byte ranges, and in what order the group exchanges
them.

Owns a pure function of (listing, mode, world size, chunk size), so every rank computes the same
plan without talking; `Plan.fingerprint` lets the group confirm that. Files are cut into chunks at
multiples of `chunk_bytes` (the same chunks the manifest hashes), never at tensor boundaries, so a
large tensor is spread over several ranks; an object whose store checksum is of its upload's parts
is cut at its part boundaries instead (`chunk_bytes_for_parts`). Modes: `multi-reader` balances
bytes over all ranks (largest chunks first, each to the least-loaded rank: no rank ends more than
one chunk above the mean); `single-reader` gives rank 0 everything; `independent` is a group of
one. Where some ranks' nodes hold the entry already (`sources`), only they read, from disk, and
the others read nothing from the store. Round `k` of the exchange moves the `k`-th chunk of
every rank that has one round the ring.

[Note: short chunks last] In a group, each rank reads its chunks longest first (file order
among equal lengths), so the files' short last chunks make up the last rounds. Nothing of the
last round can move before it is read, so its ring is the tail of the fill: `(N - 1)` times the
round's longest chunk over the peer link after the last byte arrives from the store. With the
short chunks last, that is a short chunk's, and the last reads end sooner too. A group of one
has no rounds and reads in file order.
Called by `fill` and `exchange`. Must not do I/O.
"""

from __future__ import annotations

import hashlib
import heapq
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

from dlo_loader.digest import ALGORITHM
from dlo_contract.cache import ObjectIdentity

MODES = ("multi-reader", "single-reader", "independent")


@dataclass(frozen=True)
class Chunk:
    """Bytes `[offset, offset+length)` of `files[file]`; `number` is its index within that file
    (its position in the file's manifest chunk list)."""

    index: int
    file: int
    number: int
    offset: int
    length: int
    owner: int


@dataclass(frozen=True)
class Plan:
    mode: str
    world_size: int
    chunk_bytes: int
    """The largest chunk: what a chunk buffer holds."""
    files: tuple[ObjectIdentity, ...]
    chunks: tuple[Chunk, ...]
    algorithms: tuple[str, ...]
    """Per file: the digest of its chunks (`digest.algorithm_for`)."""
    file_chunk_bytes: tuple[int, ...]
    """Per file: where its chunks are cut (`chunk_bytes`, or less for an object cut at its
    parts), as its manifest record says."""
    part_bytes: tuple[int | None, ...]
    """Per file: the size of its upload's parts (all but the last) where the store's checksum
    of it is of its parts, else None."""

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def owned(self, rank: int) -> tuple[Chunk, ...]:
        """The chunks `rank` reads from the store (or its disk), in reading and round order:
        in a group longest first, file order among equal lengths (see [Note: short chunks
        last]); alone in file order."""
        return self._by_owner[rank] if rank < len(self._by_owner) else ()

    def owned_bytes(self, rank: int) -> int:
        return sum(c.length for c in self.owned(rank))

    @cached_property
    def _by_owner(self) -> tuple[tuple[Chunk, ...], ...]:
        owners = [[] for _ in range(self.world_size)]
        order = (sorted(self.chunks, key=lambda c: (-c.length, c.index)) if self.world_size > 1
                 else self.chunks)  # alone, nothing waits on rounds: file order
        for chunk in order:
            owners[chunk.owner].append(chunk)
        return tuple(tuple(o) for o in owners)

    @cached_property
    def rounds(self) -> tuple[tuple[Chunk, ...], ...]:
        """Round k: the k-th owned chunk of each rank that has one, in rank order."""
        depth = max((len(o) for o in self._by_owner), default=0)
        return tuple(
            tuple(o[k] for o in self._by_owner if k < len(o)) for k in range(depth)
        )

    @cached_property
    def fingerprint(self) -> str:
        """SHA-256 of everything that must agree across ranks."""
        described = {
            "mode": self.mode, "world_size": self.world_size, "chunk_bytes": self.chunk_bytes,
            "files": [[f.key, f.size, f.etag, a, c, p] for f, a, c, p in zip(
                self.files, self.algorithms, self.file_chunk_bytes, self.part_bytes)],
            "owners": [c.owner for c in self.chunks],
        }
        return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


def build_plan(
    files: tuple[ObjectIdentity, ...] | list[ObjectIdentity], *, mode: str, world_size: int,
    chunk_bytes: int, algorithms: Mapping[str, str] | None = None,
    part_bytes: Mapping[str, int] | None = None, sources: Sequence[int] = (),
) -> Plan:
    """Cut `files` into chunks and assign each an owner rank according to `mode`; `algorithms`:
    the digest of each file's chunks by key (`digest.ALGORITHM` for a file not named);
    `part_bytes`: by key, the part size of each object to cut at its parts; `sources`: the
    ranks that read (those whose node holds the entry), in place of every rank."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {MODES}")
    if world_size < 1 or chunk_bytes < 1:
        raise ValueError(f"world_size={world_size} and chunk_bytes={chunk_bytes} must be >= 1")
    ordered = tuple(sorted(files, key=lambda f: f.key))
    cut_at_parts = [(p, chunk_bytes_for_parts(p, chunk_bytes) if p else None)
                    for p in ((part_bytes or {}).get(f.key) for f in ordered)]
    parts = tuple(p if cut else None for p, cut in cut_at_parts)
    cuts = tuple(cut or chunk_bytes for _, cut in cut_at_parts)
    pieces = [
        (file_index, number, offset, min(cut, obj.size - offset))
        for file_index, (obj, cut) in enumerate(zip(ordered, cuts))
        for number, offset in enumerate(range(0, obj.size, cut))
    ]
    group = 1 if mode == "independent" else world_size
    readers = sorted(sources) if sources and group > 1 else list(range(group))
    if mode == "multi-reader":
        owners = [readers[i] for i in _balance([p[3] for p in pieces], len(readers))]
    else:
        owners = [readers[0]] * len(pieces)
    chunks = tuple(
        Chunk(index=i, file=f, number=n, offset=o, length=n_bytes, owner=owner)
        for i, ((f, n, o, n_bytes), owner) in enumerate(zip(pieces, owners))
    )
    named = algorithms or {}
    return Plan(mode=mode, world_size=group, chunk_bytes=chunk_bytes, files=ordered, chunks=chunks,
                algorithms=tuple(named.get(f.key, ALGORITHM) for f in ordered),
                file_chunk_bytes=cuts, part_bytes=parts)


def chunk_bytes_for_parts(part_bytes: int, chunk_bytes: int) -> int | None:
    """Where to cut an object uploaded in parts of `part_bytes` (the last may be shorter) so that
    every part boundary is a chunk boundary and no chunk exceeds `chunk_bytes`: the part size
    divided by the fewest parts that fit (a part of 8 MiB is one chunk, of 100 MiB with 16 MiB
    chunks eight of 12.5 MiB); None where that takes chunks under half the size that would fit
    (a part size with no divisor near it: the object is cut as any other). Only cut this way
    can a part's CRC be combined from its chunks' (see [Note: composite checksums] in
    `digest`)."""
    fewest = -(-part_bytes // chunk_bytes)
    for count in range(fewest, 2 * fewest + 1):
        if part_bytes % count == 0:
            return part_bytes // count
    return None


def _balance(lengths: list[int], ranks: int) -> list[int]:
    """Largest first, each to the least-loaded rank (ties: fewer chunks, then lower rank)."""
    heap = [(0, 0, rank) for rank in range(ranks)]
    owners = [0] * len(lengths)
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        load, count, rank = heapq.heappop(heap)
        owners[index] = rank
        heapq.heappush(heap, (load + lengths[index], count + 1, rank))
    return owners
