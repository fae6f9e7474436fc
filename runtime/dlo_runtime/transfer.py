"""Host sources of streamed blocks, and the transfers that fill a device slot from them.

Owns the host side of the hot path, in four forms chosen by the backend:
- `ShardStore`: this rank's 1/G of every streamed block, packed per dtype (page-locked on CUDA).
  A load copies the shard into its place in the slot and, when G > 1, rebuilds the block in place
  with one AllGather per dtype over the existing group. G = 1 is rank-local mode with the
  loader's ordinary tensors: whole blocks packed once at enable.
- `StagedSource`: rank-local mode over mapped files that are not registered with the device
  runtime: each block is packed into one of two bounded host staging slots, then copied.
- `DirectSource`: rank-local mode over registered (pinned) views: each view is copied straight
  to its offset in the slot.
- `MappedSource`: rank-local mode on the CPU over mapped files: the mapped views are the block's
  weights (the device is the host; a copy would only double the bytes the forward reads), but
  for views off the alignment a fresh allocation has, which are copied into the slot.
Called by the hook scheduler; it must not repoint parameters or decide which block comes next.
Every event record and wait follows [Note: slot events] in `dlo_runtime.slots`.

[Note: host arena] Host buffers are allocated as one arena per dtype (`host_arena`) holding every
block's part at an aligned offset, with per-block views into it, never one buffer per block. On
CUDA each arena is page-locked at its requested size rounded up to one page
(`dlo_runtime.pinned_arena`), not through PyTorch's caching host allocator, which would round it
up to a power of two; one buffer per block would still cost a page and a registration call per
block. Storage sizes, which `host_bytes` sums, report the bytes requested.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from dlo_runtime.layout import BlockLayout, arena_offsets, slot_sizes, views
from dlo_runtime.slots import DeviceSlot
from dlo_runtime.streams import StreamSet


def _wait_reusable(streams: StreamSet, slot: DeviceSlot) -> None:
    """Make the copy stream wait until nothing reads or writes `slot` any more."""
    # free: the kernels of the block that last used this slot must finish before we overwrite.
    streams.copy.wait_event(slot.free)
    # ready: a previous transfer into this slot (a prefetch that was never used) must finish
    # before this one writes, or the two would interleave.
    streams.copy.wait_event(slot.ready)


def host_arena(
    streams: StreamSet, parts: Sequence[Mapping[torch.dtype, int]]
) -> tuple[list[torch.Tensor], list[dict[torch.dtype, torch.Tensor]]]:
    """One zeroed host buffer per dtype holding every part (elements per dtype), and each part's
    views into it; see [Note: host arena]."""
    totals, offsets = arena_offsets(parts, streams.align_bytes)
    # zeroed: padding is gathered into the slots too, so it must not carry stale host bytes.
    flats = {dtype: streams.host_empty(size, dtype).zero_() for dtype, size in totals.items()}
    return list(flats.values()), [
        {dtype: flats[dtype].narrow(0, start, part[dtype]) for dtype, start in placed.items()}
        for part, placed in zip(parts, offsets)
    ]


class ShardStore:
    """This rank's shard of every streamed block; rebuilt on the device by AllGather."""

    def __init__(
        self,
        layouts: Sequence[BlockLayout],
        sources: Mapping[str, torch.Tensor],
        streams: StreamSet,
        *,
        group: dist.ProcessGroup | None,
        rank: int,
    ) -> None:
        self.layouts = layouts
        self.streams = streams
        self.group = group
        self.rank = rank
        self.arena, self.shards = host_arena(streams, [layout.shard_numels for layout in layouts])
        """`shards[block][dtype]`: this rank's part of the block, a view into `arena`."""
        for index in range(len(layouts)):
            self._fill(index, sources)

    def _fill(self, index: int, sources: Mapping[str, torch.Tensor]) -> None:
        """Copy the part of each tensor of block `index` that falls in this rank's shard."""
        layout = self.layouts[index]
        for entry in layout.entries:
            shard_numel = layout.shard_numels[entry.meta.dtype]
            lo = self.rank * shard_numel
            start = max(entry.offset, lo)
            stop = min(entry.offset + entry.meta.numel, lo + shard_numel)
            if start >= stop:
                continue
            flat = sources[entry.meta.name].reshape(-1)
            self.shards[index][entry.meta.dtype][start - lo : stop - lo].copy_(
                flat[start - entry.offset : stop - entry.offset]
            )

    def host_tensors(self) -> list[torch.Tensor]:
        return list(self.arena)

    def load(self, index: int, slot: DeviceSlot) -> None:
        """Issue the transfer of block `index` into `slot`; `slot.ready` marks its end."""
        layout = self.layouts[index]
        with self.streams.on(self.streams.copy):
            _wait_reusable(self.streams, slot)
            for dtype, size in layout.shard_numels.items():
                part = slot.flats[dtype].narrow(0, self.rank * size, size)
                part.copy_(self.shards[index][dtype], non_blocking=True)
            # staged: the AllGather below reads this rank's part only after its copy lands.
            slot.staged.record(self.streams.copy)
        if self.group is None:
            # ready: compute waits on this before the block reads the slot (no collective).
            slot.ready.record(self.streams.copy)
            return
        with self.streams.on(self.streams.comm):
            # staged: gathering before the shard's copy lands would send stale bytes.
            self.streams.comm.wait_event(slot.staged)
            for dtype, size in layout.shard_numels.items():  # [Note: dtype order]
                whole = slot.flats[dtype].narrow(0, 0, size * layout.shard_count)
                part = whole.narrow(0, self.rank * size, size)
                dist.all_gather_single(
                    whole.view(torch.uint8), part.view(torch.uint8), group=self.group
                )
            # ready: compute waits on this before the block reads the gathered weights.
            slot.ready.record(self.streams.comm)


class StagedSource:
    """Rank-local blocks from pageable mapped views, through two bounded staging slots."""

    def __init__(
        self,
        layouts: Sequence[BlockLayout],
        sources: Mapping[str, torch.Tensor],
        streams: StreamSet,
    ) -> None:
        self.layouts = layouts
        self.streams = streams
        self.sources = [[sources[e.meta.name] for e in layout.entries] for layout in layouts]
        sizes = slot_sizes(layouts)
        self.arena, self.staging = host_arena(streams, [sizes, sizes])
        """Two staging slots (`staging[which][dtype]`), views into one `arena` per dtype."""
        self.consumed = [streams.event(), streams.event()]
        self.next = 0

    def host_tensors(self) -> list[torch.Tensor]:
        return self.arena + [t for block in self.sources for t in block]

    def load(self, index: int, slot: DeviceSlot) -> None:
        """Pack block `index` into a staging slot, then copy it to `slot`."""
        layout = self.layouts[index]
        which, self.next = self.next, 1 - self.next
        staging = self.staging[which]
        # consumed: the host must not repack a staging slot whose previous device copy is still
        # reading it. Issued one block earlier, so this wait is normally already satisfied; it
        # is what bounds host staging to two slots.
        self.consumed[which].synchronize()
        for target, source in zip(views(layout, staging), self.sources[index]):
            target.copy_(source)
        with self.streams.on(self.streams.copy):
            _wait_reusable(self.streams, slot)
            for dtype, size in layout.numels.items():
                slot.flats[dtype].narrow(0, 0, size).copy_(
                    staging[dtype].narrow(0, 0, size), non_blocking=True
                )
            # consumed: marks when this staging slot may be packed again.
            self.consumed[which].record(self.streams.copy)
            # ready: compute waits on this before the block reads the slot.
            slot.ready.record(self.streams.copy)


class DirectSource:
    """Rank-local blocks copied view by view from sources the device can read directly."""

    def __init__(
        self,
        layouts: Sequence[BlockLayout],
        sources: Mapping[str, torch.Tensor],
        streams: StreamSet,
        slot_views: Sequence[Sequence[list[torch.Tensor]]],
    ) -> None:
        self.streams = streams
        self.sources = [[sources[e.meta.name] for e in layout.entries] for layout in layouts]
        self.slot_views = slot_views

    def host_tensors(self) -> list[torch.Tensor]:
        return [t for block in self.sources for t in block]

    def load(self, index: int, slot: DeviceSlot) -> None:
        with self.streams.on(self.streams.copy):
            _wait_reusable(self.streams, slot)
            for target, source in zip(self.slot_views[slot.index][index], self.sources[index]):
                target.copy_(source, non_blocking=True)
            # ready: compute waits on this before the block reads the slot.
            slot.ready.record(self.streams.copy)


class MappedSource:
    """Rank-local blocks on the CPU, used where the entry's mapping holds them.

    The scheduler points a block's tensors at `views[block]` (read-only mapped pages: the forward
    reads them, nothing writes weights under inference) and a load copies nothing, except the
    views that lie off the alignment compute gets (see [Note: compute alignment]). The first
    forward after a fill reads the pages the loader or the runtime's prefetch left in the page
    cache; later forwards find them resident.

    [Note: compute alignment] A checkpoint's tensors sit where its publisher's writer put them:
    the safetensors format aligns them for their dtype only (diffusers' files: 8 bytes). A
    resident model's tensors are fresh allocations, aligned to `streams.align_bytes` (64 on the
    CPU), and CPU matmul kernels may round differently for an operand that is not (AVX-512
    kernels do: outputs then differ in the last bit from the resident model's). So a view that
    is not aligned is copied into its place in the slot at each load, as a device would copy
    it, and an aligned view is used in place (zero-copy). Slots hold memory only when some view
    needs them."""

    def __init__(self, layouts: Sequence[BlockLayout], sources: Mapping[str, torch.Tensor],
                 streams: StreamSet) -> None:
        self.streams = streams
        self.layouts = layouts
        self.views = [[sources[e.meta.name] for e in layout.entries] for layout in layouts]
        """`views[block]`: the mapped tensors of the block, in layout order."""
        self.copied = [[not aligned(view, streams.align_bytes) for view in block]
                       for block in self.views]
        """`copied[block][entry]`: the view is copied into the slot at each load."""
        self._copies: list[list[list[tuple[torch.Tensor, torch.Tensor]]]] = []
        """`_copies[slot][block]`: (place in the slot, view) of each view a load copies, made
        once by `bind` so that a load walks only those."""

    def slot_sizes(self) -> dict[torch.dtype, int]:
        """Elements per dtype a slot needs: none unless some block has a view to copy."""
        return slot_sizes([layout for layout, copied in zip(self.layouts, self.copied)
                           if any(copied)])

    def bind(self, slots: Sequence[DeviceSlot]) -> list[list[list[torch.Tensor]]]:
        """Per slot and block, the view itself where it is used in place, else its place in
        the slot; the pairs to copy are kept for `load`."""
        slot_views = []
        self._copies = []
        for slot in slots:
            per_block = []
            copies = []
            for layout, block, copied in zip(self.layouts, self.views, self.copied):
                places = views(layout, slot.flats) if any(copied) else block
                per_block.append([place if copy else view
                                  for view, place, copy in zip(block, places, copied)])
                copies.append([(place, view)
                               for view, place, copy in zip(block, places, copied) if copy])
            slot_views.append(per_block)
            self._copies.append(copies)
        return slot_views

    def copied_bytes(self) -> list[int]:
        """Per block, the bytes one load copies (the views off alignment)."""
        return [sum(view.nbytes for view, copy in zip(block, copied) if copy)
                for block, copied in zip(self.views, self.copied)]

    def host_tensors(self) -> list[torch.Tensor]:
        return [t for block in self.views for t in block]

    def load(self, index: int, slot: DeviceSlot) -> None:
        with self.streams.on(self.streams.copy):
            _wait_reusable(self.streams, slot)
            for target, view in self._copies[slot.index][index]:
                target.copy_(view)
            # ready: recorded so the slot's bookkeeping is the same as a copy's.
            slot.ready.record(self.streams.copy)


def aligned(tensor: torch.Tensor, align_bytes: int) -> bool:
    """True when `tensor`'s data starts at a multiple of `align_bytes`, as a fresh allocation's
    does (an empty tensor has no data to misplace)."""
    return tensor.numel() == 0 or tensor.data_ptr() % align_bytes == 0
