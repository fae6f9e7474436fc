"""What feeds a backend's two device slots: the source-kind decision, made once, and its build.

Owns the table that picks the host source of the streamed blocks from the host plan, the
placement and the device (`source_kind`), and the building of that source with the device slots
it fills (`build_feed`): a mapped entry used in place needs slots only for the views it must
copy ([Note: compute alignment] in `transfer`), every other source fills whole-block slots.
Called by `offload_setup.build_setup` (the backend's `enable`); it starts no transfer and must
not read the settings (the placement decided the group).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from dlo_runtime.layout import BlockLayout, slot_sizes, views
from dlo_runtime.slots import DeviceSlots
from dlo_runtime.streams import StreamSet
from dlo_runtime.transfer import DirectSource, MappedSource, ShardStore, StagedSource

HostSource = ShardStore | StagedSource | DirectSource | MappedSource
SlotViews = list[list[list[torch.Tensor]]]
"""Per slot, per streamed block, the views of each tensor in the slot's flat buffers."""


class BackedPlan(Protocol):
    """What the decision reads of a host weight plan."""

    backing_kind: Any
    sources_pinned: bool


class SourceKind(enum.Enum):
    """The host source of the streamed blocks."""

    SHARDS = "shards"
    """Host shards copied from the tensors: AllGather over a group, or ordinary tensors."""
    MAPPED = "mapped"
    """Rank-local blocks used where the mapped entry holds them (the device computes on host
    memory); the slots hold only the views that must be copied to be aligned."""
    DIRECT = "direct"
    """Rank-local mapped views registered with the device runtime, copied straight into the
    slots."""
    STAGED = "staged"
    """Rank-local mapped views copied through page-locked staging buffers."""


def source_kind(plan: BackedPlan | None, *, grouped: bool, streams: StreamSet) -> SourceKind:
    """The one decision table: no plan, a group (AllGather), or ordinary tensors make host
    shards; a mapped plan is used in place where the device reads host memory in place, copied
    directly where its pages are registered and the device copies registered views, else
    staged."""
    backing = str(getattr(plan.backing_kind, "value", plan.backing_kind)) if plan else None
    if plan is None or grouped or backing == "ordinary":
        return SourceKind.SHARDS
    if streams.reads_host_in_place:
        return SourceKind.MAPPED
    if plan.sources_pinned and streams.copies_registered_views:
        return SourceKind.DIRECT
    return SourceKind.STAGED


@dataclass(frozen=True)
class SlotFeed:
    """A built source and the slots it fills."""

    source: HostSource
    slots: DeviceSlots
    slot_views: SlotViews


def build_feed(kind: SourceKind, layouts: Sequence[BlockLayout],
               sources: Mapping[str, torch.Tensor], streams: StreamSet, *, group: Any,
               rank: int) -> SlotFeed:
    """The source `kind` names over `sources`, and the device slots it fills."""
    if kind is SourceKind.MAPPED:
        # The mapped source decides the slots' size: only views off the alignment are copied.
        mapped = MappedSource(layouts, sources, streams)
        slots = DeviceSlots(mapped.slot_sizes(), streams)
        return SlotFeed(mapped, slots, mapped.bind(slots.slots))
    slots = DeviceSlots(slot_sizes(layouts), streams)
    slot_views = [[views(layout, slot.flats) for layout in layouts] for slot in slots.slots]
    source: HostSource
    if kind is SourceKind.SHARDS:
        source = ShardStore(layouts, sources, streams, group=group, rank=rank)
    elif kind is SourceKind.DIRECT:
        source = DirectSource(layouts, sources, streams, slot_views)
    else:
        source = StagedSource(layouts, sources, streams)
    return SlotFeed(source, slots, slot_views)
