"""The two device slots that streamed blocks rotate through, and their lifecycle.

Owns the device memory of the hot path: two slots, each one flat buffer per dtype sized for the
largest streamed block (see `dlo_runtime.layout`), the events that order transfers against
compute, and the state of each slot. Called by the transfers (which fill a slot) and the hook
scheduler (which hands a slot to a block); it must not copy data or issue collectives itself.

[Note: slot events] Each slot carries three events:
- `staged`: this rank's part is in the slot (recorded on the copy stream). The AllGather on the
  communication stream waits on it, so it never gathers a shard that is still being copied.
- `ready`: the whole block is in the slot (recorded on the stream of the last transfer). The
  compute stream waits on it before the block runs, so kernels never read half-copied weights.
- `free`: the block's kernels have been queued (recorded on the compute stream after the block).
  The next transfer into the slot waits on it, so it never overwrites weights still being read.
A new transfer also waits on `ready` of the previous one, so that a prefetch which was never
used (a skipped block) cannot race with its replacement.
"""

from __future__ import annotations

import enum

import torch

from dlo_runtime.streams import Event, StreamSet
from dlo_runtime.errors import SlotStateError


class SlotState(enum.Enum):
    """Lifecycle of one device slot."""

    EMPTY = "empty"
    """Holds no block."""
    LOADING = "loading"
    """A transfer was issued; `ready` marks its completion on the device."""
    IN_USE = "in_use"
    """The block's tensors point into the slot; its kernels may be queued or running."""
    RELEASED = "released"
    """The block ran; `free` marks when its kernels end. The contents stay valid for reuse."""


class DeviceSlot:
    """One per-dtype set of flat device buffers and the block it currently holds."""

    def __init__(
        self, index: int, sizes: dict[torch.dtype, int], streams: StreamSet
    ) -> None:
        self.index = index
        self.flats = {
            dtype: torch.empty(size, dtype=dtype, device=streams.device)
            for dtype, size in sizes.items()
        }
        self.staged: Event = streams.event()
        self.ready: Event = streams.event()
        self.free: Event = streams.event()
        self.state = SlotState.EMPTY
        self.block: int | None = None

    @property
    def nbytes(self) -> int:
        return sum(flat.numel() * flat.element_size() for flat in self.flats.values())

    def holds(self, block: int) -> bool:
        """True when the slot's contents are `block`'s weights (loaded, loading or in use)."""
        return self.block == block and self.state is not SlotState.EMPTY

    def begin_load(self, block: int) -> None:
        """EMPTY/LOADING/RELEASED -> LOADING: a transfer of `block` is about to be issued."""
        if self.state is SlotState.IN_USE:
            raise SlotStateError(
                f"slot {self.index} holds block {self.block} in use; cannot load block {block}"
            )
        self.state = SlotState.LOADING
        self.block = block

    def use(self) -> None:
        """LOADING/RELEASED -> IN_USE: the block's tensors now point into the slot."""
        if self.state not in (SlotState.LOADING, SlotState.RELEASED):
            raise SlotStateError(f"slot {self.index} is {self.state.value}; cannot use it")
        self.state = SlotState.IN_USE

    def release(self) -> None:
        """IN_USE -> RELEASED: the block's kernels are queued and `free` is recorded."""
        if self.state is not SlotState.IN_USE:
            raise SlotStateError(f"slot {self.index} is {self.state.value}; cannot release it")
        self.state = SlotState.RELEASED

    def clear(self) -> None:
        """Any -> EMPTY: forget the contents (after a synchronize, at disable)."""
        self.state = SlotState.EMPTY
        self.block = None


class DeviceSlots:
    """The pair of slots. Allocated by `enable`, dropped by `disable`."""

    def __init__(self, sizes: dict[torch.dtype, int], streams: StreamSet) -> None:
        self.slots = (DeviceSlot(0, sizes, streams), DeviceSlot(1, sizes, streams))

    def __getitem__(self, index: int) -> DeviceSlot:
        return self.slots[index]

    @property
    def nbytes(self) -> int:
        """Device bytes of both slots: twice the largest streamed block (padded)."""
        return sum(slot.nbytes for slot in self.slots)

    def find(self, block: int) -> DeviceSlot | None:
        """The slot holding `block`, if any."""
        for slot in self.slots:
            if slot.holds(block):
                return slot
        return None

    def other(self, slot: DeviceSlot) -> DeviceSlot:
        return self.slots[1 - slot.index]

    def clear(self) -> None:
        for slot in self.slots:
            slot.clear()
