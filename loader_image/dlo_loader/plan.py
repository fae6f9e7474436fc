"""The transfer plan: which rank reads which byte ranges, and in what order the group exchanges
them.

Owns a pure function of (listing, mode, world size, chunk size), so every rank computes the same
plan without talking; `Plan.fingerprint` lets the group confirm that. Files are cut into chunks at
multiples of `chunk_bytes` (the same chunks the manifest hashes), never at tensor boundaries, so a
large tensor is spread over several ranks. Modes: `multi-reader` balances bytes over all ranks
(largest chunks first, each to the least-loaded rank: no rank ends more than one chunk above the
mean); `single-reader` gives rank 0 everything; `independent` is a group of one. Round `k` of the
exchange moves the `k`-th chunk of every rank that has one round the ring. Called by `fill`
and `exchange`. Must not do I/O.
"""

from __future__ import annotations

import hashlib
import heapq
import json
from collections.abc import Mapping
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
    files: tuple[ObjectIdentity, ...]
    chunks: tuple[Chunk, ...]
    algorithms: tuple[str, ...]
    """Per file: the digest of its chunks (`digest.algorithm_for`)."""

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def owned(self, rank: int) -> tuple[Chunk, ...]:
        """The chunks `rank` reads from the store (or its disk), in file order."""
        return self._by_owner[rank] if rank < len(self._by_owner) else ()

    def owned_bytes(self, rank: int) -> int:
        return sum(c.length for c in self.owned(rank))

    @cached_property
    def _by_owner(self) -> tuple[tuple[Chunk, ...], ...]:
        owners = [[] for _ in range(self.world_size)]
        for chunk in self.chunks:
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
            "files": [[f.key, f.size, f.etag, a] for f, a in zip(self.files, self.algorithms)],
            "owners": [c.owner for c in self.chunks],
        }
        return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


def build_plan(
    files: tuple[ObjectIdentity, ...] | list[ObjectIdentity], *, mode: str, world_size: int,
    chunk_bytes: int, algorithms: Mapping[str, str] | None = None,
) -> Plan:
    """Cut `files` into chunks and assign each an owner rank according to `mode`; `algorithms`:
    the digest of each file's chunks by key (`digest.ALGORITHM` for a file not named)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {MODES}")
    if world_size < 1 or chunk_bytes < 1:
        raise ValueError(f"world_size={world_size} and chunk_bytes={chunk_bytes} must be >= 1")
    ordered = tuple(sorted(files, key=lambda f: f.key))
    pieces = [
        (file_index, number, offset, min(chunk_bytes, obj.size - offset))
        for file_index, obj in enumerate(ordered)
        for number, offset in enumerate(range(0, obj.size, chunk_bytes))
    ]
    group = 1 if mode == "independent" else world_size
    if mode == "multi-reader":
        owners = _balance([p[3] for p in pieces], group)
    else:
        owners = [0] * len(pieces)
    chunks = tuple(
        Chunk(index=i, file=f, number=n, offset=o, length=n_bytes, owner=owner)
        for i, ((f, n, o, n_bytes), owner) in enumerate(zip(pieces, owners))
    )
    named = algorithms or {}
    return Plan(mode=mode, world_size=group, chunk_bytes=chunk_bytes, files=ordered, chunks=chunks,
                algorithms=tuple(named.get(f.key, ALGORITHM) for f in ordered))


def _balance(lengths: list[int], ranks: int) -> list[int]:
    """Largest first, each to the least-loaded rank (ties: fewer chunks, then lower rank)."""
    heap = [(0, 0, rank) for rank in range(ranks)]
    owners = [0] * len(lengths)
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        load, count, rank = heapq.heappop(heap)
        owners[index] = rank
        heapq.heappush(heap, (load + lengths[index], count + 1, rank))
    return owners
