"""Flat per-dtype layout of a streamed block: where each tensor lives in a slot buffer.

Owns the arithmetic shared by the device slots, the host shards and the staging slots: every
streamed block is one flat buffer per dtype, each tensor at an aligned element offset, the whole
padded so that it splits into `shard_count` equal, aligned shards (one per rank of the AllGather
group); and the placement of many such parts in one host arena per dtype. Called by the backend
and the host sources when they build their buffers; it allocates nothing.

[Note: dtype order] `numels` and `shard_numels` are built in `dtype_order` (a sort by name), and
every loop over a block's dtypes iterates them, so that all ranks issue their per-dtype
collectives in the same order.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

ALIGN_BYTES = 64
"""Default start of every tensor and every shard inside a flat buffer on the CPU: a cache line,
which costs no padding even on tiny DiT tensors."""
CUDA_ALIGN_BYTES = 256
"""On CUDA: PyTorch hands cuBLAS the alignment of each operand (up to 256 bytes) and the library
may pick a different kernel for a lesser one, so slot views get the alignment that freshly
allocated tensors have; otherwise offloaded outputs could differ in the last bits."""


@dataclass(frozen=True)
class TensorMeta:
    """Name, shape and dtype of one parameter or persistent buffer of a block."""

    name: str
    """Relative to the DiT, as in `named_parameters()` / `named_buffers()`."""
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count


@dataclass(frozen=True)
class Entry:
    """Where one tensor sits in its dtype's flat buffer (offsets in elements)."""

    meta: TensorMeta
    offset: int


@dataclass(frozen=True)
class BlockLayout:
    """Placement of one block's tensors in per-dtype flat buffers."""

    path: str
    entries: tuple[Entry, ...]
    """In the block's `named_parameters()` then `named_buffers()` order."""
    numels: dict[torch.dtype, int]
    """Padded elements per dtype, in `dtype_order`: a multiple of `shard_count` aligned shards."""
    shard_numels: dict[torch.dtype, int]
    """Elements of one rank's shard per dtype (`numels / shard_count`), same order."""
    shard_count: int
    """Ranks the block is split over (G), one shard each."""

    @property
    def nbytes(self) -> int:
        """Bytes of the padded flat buffers: what one device slot needs for this block."""
        return sum(size * dtype.itemsize for dtype, size in self.numels.items())

    @property
    def tensor_bytes(self) -> int:
        """Bytes of the tensors themselves, without padding."""
        return sum(e.meta.numel * e.meta.dtype.itemsize for e in self.entries)


def align_elements(dtype: torch.dtype, align_bytes: int = ALIGN_BYTES) -> int:
    """Elements of `dtype` in `align_bytes`."""
    return max(1, align_bytes // dtype.itemsize)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def dtype_order(dtypes: Iterable[torch.dtype]) -> list[torch.dtype]:
    """Deterministic order across ranks (see [Note: dtype order])."""
    return sorted(set(dtypes), key=str)


def build_layout(
    path: str, metas: Sequence[TensorMeta], shard_count: int, align_bytes: int = ALIGN_BYTES
) -> BlockLayout:
    """Place `metas` at aligned offsets, per dtype, padded to `shard_count` aligned shards."""
    cursor: dict[torch.dtype, int] = {}
    entries = []
    for meta in metas:
        start = _round_up(cursor.get(meta.dtype, 0), align_elements(meta.dtype, align_bytes))
        entries.append(Entry(meta, start))
        cursor[meta.dtype] = start + meta.numel
    shards = {
        dtype: _round_up(-(-cursor[dtype] // shard_count), align_elements(dtype, align_bytes))
        for dtype in dtype_order(cursor)
    }
    return BlockLayout(
        path=path,
        entries=tuple(entries),
        numels={dtype: shard * shard_count for dtype, shard in shards.items()},
        shard_numels=shards,
        shard_count=shard_count,
    )


def slot_sizes(layouts: Sequence[BlockLayout]) -> dict[torch.dtype, int]:
    """Elements per dtype a device slot needs to hold any of `layouts`."""
    sizes: dict[torch.dtype, int] = {}
    for layout in layouts:
        for dtype, size in layout.numels.items():
            sizes[dtype] = max(sizes.get(dtype, 0), size)
    return {dtype: sizes[dtype] for dtype in dtype_order(sizes)}


def views(layout: BlockLayout, flats: dict[torch.dtype, torch.Tensor]) -> list[torch.Tensor]:
    """One view per entry of `layout` into `flats` (one flat tensor per dtype)."""
    return [
        flats[e.meta.dtype].narrow(0, e.offset, e.meta.numel).view(e.meta.shape)
        for e in layout.entries
    ]


def arena_offsets(
    parts: Sequence[Mapping[torch.dtype, int]], align_bytes: int = ALIGN_BYTES
) -> tuple[dict[torch.dtype, int], list[dict[torch.dtype, int]]]:
    """Pack `parts` (elements per dtype each) one after another in one buffer per dtype.

    Returns the elements each dtype's buffer needs (in `dtype_order`) and, per part, the
    aligned element offset of each of its dtypes."""
    cursor: dict[torch.dtype, int] = {}
    offsets = []
    for part in parts:
        placed = {}
        for dtype, size in part.items():
            placed[dtype] = _round_up(cursor.get(dtype, 0), align_elements(dtype, align_bytes))
            cursor[dtype] = placed[dtype] + size
        offsets.append(placed)
    return {dtype: cursor[dtype] for dtype in dtype_order(cursor)}, offsets
