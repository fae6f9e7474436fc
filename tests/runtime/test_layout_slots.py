"""Flat per-dtype layouts (aligned offsets, equal aligned shards), host arenas (one storage per
dtype, counted once) and the slot lifecycle."""

from __future__ import annotations

import pytest
import torch

from dlo_runtime.backend import host_bytes
from dlo_runtime.layout import (
    ALIGN_BYTES,
    TensorMeta,
    arena_offsets,
    build_layout,
    dtype_order,
    slot_sizes,
    views,
)
from dlo_runtime.slots import DeviceSlots, SlotState, SlotStateError
from dlo_runtime.streams import StreamSet
from dlo_runtime.transfer import host_arena

METAS = [
    TensorMeta("b.w", (3, 5), torch.float32),
    TensorMeta("b.n", (7,), torch.bfloat16),
    TensorMeta("b.v", (11,), torch.float32),
    TensorMeta("b.s", (2, 2), torch.float64),
]


@pytest.mark.parametrize("shards", [1, 2, 3])
def test_offsets_and_shards_are_aligned(shards: int) -> None:
    layout = build_layout("b", METAS, shards)
    for entry in layout.entries:
        itemsize = torch.empty((), dtype=entry.meta.dtype).element_size()
        assert entry.offset * itemsize % ALIGN_BYTES == 0
    for dtype, shard in layout.shard_numels.items():
        itemsize = torch.empty((), dtype=dtype).element_size()
        assert shard * itemsize % ALIGN_BYTES == 0
        assert layout.numels[dtype] == shard * shards
    assert [e.offset for e in layout.entries] == [0, 0, 16, 0]
    assert layout.tensor_bytes == 15 * 4 + 7 * 2 + 11 * 4 + 4 * 8


def test_dtype_order_is_the_same_everywhere() -> None:
    assert dtype_order([torch.float32, torch.bfloat16, torch.float64, torch.float32]) == [
        torch.bfloat16, torch.float32, torch.float64,
    ]
    assert list(build_layout("b", METAS, 2).numels) == [
        torch.bfloat16, torch.float32, torch.float64,
    ]


def test_slot_sizes_take_the_largest_block_per_dtype() -> None:
    small = build_layout("a", [TensorMeta("a.w", (4,), torch.float32)], 1)
    large = build_layout("b", METAS, 1)
    assert slot_sizes([small, large]) == large.numels


def test_views_share_the_flat_buffers() -> None:
    layout = build_layout("b", METAS, 1)
    flats = {dtype: torch.arange(size).to(dtype) for dtype, size in layout.numels.items()}
    made = views(layout, flats)
    assert [tuple(v.shape) for v in made] == [(3, 5), (7,), (11,), (2, 2)]
    assert made[2][0].item() == 16
    assert all(v.untyped_storage().data_ptr() == flats[v.dtype].untyped_storage().data_ptr()
               for v in made)


def test_arena_parts_sit_at_aligned_offsets_in_one_buffer_per_dtype() -> None:
    parts = [{torch.float32: 10, torch.bfloat16: 7}, {torch.float32: 16}, {torch.bfloat16: 3}]
    totals, offsets = arena_offsets(parts)
    assert offsets == [{torch.float32: 0, torch.bfloat16: 0}, {torch.float32: 16},
                       {torch.bfloat16: 32}]
    assert totals == {torch.bfloat16: 35, torch.float32: 32}
    assert list(totals) == dtype_order(totals)


def test_a_host_arena_is_one_storage_per_dtype_and_is_counted_once() -> None:
    parts = [{torch.float32: 10, torch.bfloat16: 7}, {torch.float32: 16}, {torch.bfloat16: 3}]
    arena, made = host_arena(StreamSet(torch.device("cpu")), parts)
    assert [flat.dtype for flat in arena] == [torch.bfloat16, torch.float32]
    assert [{dtype: v.numel() for dtype, v in part.items()} for part in made] == parts
    for flat in arena:
        storage = flat.untyped_storage().data_ptr()
        assert {v.untyped_storage().data_ptr() for part in made
                for v in part.values() if v.dtype == flat.dtype} == {storage}
    every_view = [v for part in made for v in part.values()]
    assert host_bytes(every_view + arena) == host_bytes(arena) == 35 * 2 + 32 * 4
    made[1][torch.float32].fill_(1.0)
    assert arena[1][16:].tolist() == [1.0] * 16 and arena[1][:16].count_nonzero() == 0


def test_slot_lifecycle() -> None:
    slots = DeviceSlots({torch.float32: 16}, StreamSet(torch.device("cpu")))
    assert slots.nbytes == 2 * 16 * 4
    slot = slots[0]
    with pytest.raises(SlotStateError, match="^slot 0 is empty; cannot use it$"):
        slot.use()
    slot.begin_load(4)
    assert slots.find(4) is slot and slots.other(slot) is slots[1]
    slot.use()
    with pytest.raises(SlotStateError, match="^slot 0 holds block 4 in use; cannot load block 5$"):
        slot.begin_load(5)
    slot.release()
    assert slot.state is SlotState.RELEASED and slots.find(4) is slot
    with pytest.raises(SlotStateError, match="^slot 0 is released; cannot release it$"):
        slot.release()
    slots.clear()
    assert slots.find(4) is None
