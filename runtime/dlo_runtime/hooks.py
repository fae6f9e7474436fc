"""The per-block hot path: hand a slot to each streamed block and prefetch the next one.

Owns `DistributedLayerwiseOffloadHook` (one per streamed block, installed as forward pre- and
post-hooks) and `BlockScheduler`, which they share. Before block i runs, its slot is made ready
and its tensors repointed into it, and the transfer of the block that runs next (the first after
the last; see `dlo_runtime.execution_order`) is issued into the other slot, so that it overlaps
block i's compute. After block i runs, its tensors are replaced by placeholders. Both hooks run
eagerly inside compiled regions too (see [Note: compiled graphs] in `dlo_runtime.compiled`).
Called by the model's own forward through the hooks, one forward at a time (the scheduler's
state belongs to the forward in flight; `dlo_runtime.forward_gate` admits the next one after it);
it must not allocate device memory, read settings or log above DEBUG.

[Note: collective order] In AllGather mode every load is a collective. Loads are issued only
here and at `prime`, in the order the blocks run, so ranks that run the same forward issue the
same collectives in the same order. A block that is skipped on every rank alike keeps that true.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from dlo_runtime.compiled import outside_compiled_graphs
from dlo_runtime.execution_order import ExecutionOrder
from dlo_runtime.run_stats import StatsRecorder
from dlo_runtime.slots import DeviceSlot, DeviceSlots, SlotState
from dlo_runtime.streams import StreamSet

logger = logging.getLogger(__name__)


class BlockSource(Protocol):
    def load(self, index: int, slot: DeviceSlot) -> None: ...


class BlockScheduler:
    """Slot assignment, readiness and repointing for the streamed blocks of one DiT."""

    def __init__(
        self,
        *,
        tensors: Sequence[Sequence[torch.Tensor]],
        placeholders: Sequence[Sequence[torch.Tensor]],
        slot_views: Sequence[Sequence[Sequence[torch.Tensor]]],
        slots: DeviceSlots,
        source: BlockSource,
        streams: StreamSet,
        order: ExecutionOrder,
        stats: StatsRecorder,
    ) -> None:
        self.tensors = tensors
        """Per streamed block, the Parameter and buffer objects, in layout order."""
        self.placeholders = placeholders
        """Per streamed block, an empty tensor of each entry's dtype on the device."""
        self.slot_views = slot_views
        """`slot_views[slot][block]`: views of each entry into that slot, made once at enable."""
        self.slots = slots
        self.source = source
        self.streams = streams
        self.order = order
        self.stats = stats
        self.current: DeviceSlot | None = None
        self.count = len(tensors)

    def prime(self) -> None:
        """Issue the load of the first streamed block, so the first forward need not wait."""
        self.load(self.order.first, self.slots[0])

    def acquire(self, index: int) -> DeviceSlot:
        """Make block `index` ready on the compute stream and point its tensors at its slot."""
        self.order.observe(index)
        slot = self.slots.find(index)
        if slot is None:
            target = self.slots[0] if self.current is None else self.slots.other(self.current)
            slot = self.load(index, target)
        if slot.state is not SlotState.IN_USE:
            # ready: the block's kernels must not read the slot before its transfer completes.
            self.stats.wait(self.streams.compute(), slot.ready)
            for tensor, view in zip(self.tensors[index], self.slot_views[slot.index][index]):
                tensor.data = view
            slot.use()
        self.current = slot
        return slot

    def prefetch(self, index: int, after: DeviceSlot) -> None:
        """Issue the load of block `index` into the slot that `after` does not occupy."""
        if self.slots.find(index) is None:
            self.load(index, self.slots.other(after))

    def release(self, index: int) -> None:
        """Block `index` has run: mark its slot reusable and drop its tensors' storage."""
        slot = self.slots.find(index)
        if slot is not None and slot.state is SlotState.IN_USE:
            self._release(slot)

    def release_in_use(self) -> None:
        """Release every slot still in use: a forward raised inside its block, before the
        block's post-hook ran, so its tensors still point into the slot."""
        for slot in self.slots.slots:
            if slot.state is SlotState.IN_USE:
                self._release(slot)

    def _release(self, slot: DeviceSlot) -> None:
        assert slot.block is not None
        # free: the next transfer into this slot waits until the kernels queued so far (this
        # block's) have finished reading it.
        slot.free.record(self.streams.compute())
        for tensor, placeholder in zip(self.tensors[slot.block], self.placeholders[slot.block]):
            tensor.data = placeholder
        slot.release()

    def load(self, index: int, slot: DeviceSlot) -> DeviceSlot:
        """Issue the transfer of block `index` into `slot` (in program order on every rank)."""
        if slot.state is SlotState.IN_USE:
            # Its block raised before its post-hook ran: its kernels are queued, so release it
            # now, which records `free` and keeps the transfer below from overtaking them.
            self._release(slot)
        logger.debug("dlo: loading block %d into slot %d", index, slot.index)
        slot.begin_load(index)
        self.stats.loaded(index)
        started = self.stats.copy_started()
        self.source.load(index, slot)
        self.stats.copy_ended(started)
        return slot


class DistributedLayerwiseOffloadHook:
    """Forward hooks of one streamed block: acquire + prefetch before, release after."""

    def __init__(self, position: int, scheduler: BlockScheduler) -> None:
        self.position = position
        self.scheduler = scheduler
        self.handles: list[RemovableHandle] = []

    def attach(self, module: nn.Module) -> None:
        self.handles = [
            module.register_forward_pre_hook(self.pre_forward),
            module.register_forward_hook(self.post_forward),
        ]

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    @outside_compiled_graphs
    def pre_forward(self, module: nn.Module, args: Any) -> None:
        slot = self.scheduler.acquire(self.position)
        self.scheduler.prefetch(self.scheduler.order.next_after(self.position), after=slot)

    @outside_compiled_graphs
    def post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self.scheduler.release(self.position)
