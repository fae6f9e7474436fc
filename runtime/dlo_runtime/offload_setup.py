"""What `enable` builds before any hook runs: the streamed layouts, the slot feed, every tensor's
place.

Owns `OffloadSetup`, the typed record of one enable's build, and `build_setup`, which consumes the
host weight plan (or the module's own tensors), lays out the streamed blocks in `shard_count`
parts, picks and builds the slot feed (`dlo_runtime.slot_feed`: the two device slots and the host
shards, sources or mappings behind them), moves the resident tensors to the device, puts the
on-demand modules' host copies in their arena (`dlo_runtime.on_demand`) and leaves placeholders
where the streamed tensors were. Called by `backend.enable` alone; it installs no hook (see
`dlo_runtime.installed_hooks`), starts no transfer and never creates a process group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from dlo_runtime.discovery import DiscoveredModel
from dlo_runtime.layout import BlockLayout
from dlo_runtime.offload_plan import weight_bytes
from dlo_runtime.on_demand import OnDemandModules
from dlo_runtime.slot_feed import SlotFeed, SourceKind, build_feed, source_kind
from dlo_runtime.streams import StreamSet
from dlo_runtime.tensors import ModelTensors


class HostPlan(Protocol):
    """The part of `dlo_runtime.host_weight_plan.HostWeightPlan` the backend uses."""

    backing_kind: Any
    sources_pinned: bool

    def take_tensors(self) -> dict[str, torch.Tensor]: ...

    def release_sources(self) -> None: ...


@dataclass(frozen=True)
class OffloadSetup:
    """One enable's build: the blocks found, their tensors and layouts, what feeds the slots, the
    on-demand modules, and the plan whose mappings stay open until `disable` (None when there is
    none or when the AllGather shards were copied out of it and it was released already)."""

    model: DiscoveredModel
    tensors: ModelTensors
    layouts: list[BlockLayout]
    kind: SourceKind
    feed: SlotFeed
    on_demand: OnDemandModules
    mapped_plan: HostPlan | None
    total_bytes: int
    """Weight bytes of the DiT (parameters and persistent buffers) before anything moved."""
    held_weights: bool
    """Whether the DiT held real weights (not meta tensors) before the build replaced them."""


def build_setup(dit: torch.nn.Module, model: DiscoveredModel, plan: HostPlan | None, *,
                streams: StreamSet, device: torch.device, group: dist.ProcessGroup | None,
                rank: int, shard_count: int) -> OffloadSetup:
    """Lay out and feed the streamed blocks and place every tensor (see the module docstring)."""
    total_bytes = weight_bytes(dit)
    held_weights = any(not p.is_meta for p in dit.parameters())
    tensors = ModelTensors(model)
    sources = tensors.sources(plan.take_tensors() if plan is not None else None)
    layouts = tensors.layouts(
        [block.path for block in model.streamed], tensors.streamed_names, sources,
        shard_count, streams.align_bytes,
    )
    kind = source_kind(plan, grouped=group is not None, streams=streams)
    feed = build_feed(kind, layouts, sources, streams, group=group, rank=rank)
    on_demand = _place(model, tensors, sources, layouts, streams=streams, device=device)
    mapped_plan = None if plan is None or group is not None else plan
    if plan is not None and group is not None:
        # Shards, resident and on-demand copies are made: the mappings are no longer read.
        plan.release_sources()
    tensors.place_streamed_placeholders(
        device, [[e.meta.dtype for e in layout.entries] for layout in layouts]
    )
    return OffloadSetup(model=model, tensors=tensors, layouts=layouts, kind=kind, feed=feed,
                        on_demand=on_demand, mapped_plan=mapped_plan, total_bytes=total_bytes,
                        held_weights=held_weights)


def _place(model: DiscoveredModel, tensors: ModelTensors, sources: dict[str, torch.Tensor],
           layouts: list[BlockLayout], *, streams: StreamSet,
           device: torch.device) -> OnDemandModules:
    """Put the resident tensors on the device and the on-demand modules' host copies in their
    arena, while `sources` is still readable (before a plan's mappings may be released)."""
    tensors.replace_meta()
    tensors.place_resident(sources, device)
    on_demand_layouts = tensors.layouts(
        [e.path for e in model.on_demand], tensors.on_demand_names, sources, 1,
        streams.align_bytes,
    )
    return OnDemandModules(on_demand_layouts, tensors.on_demand_tensors, sources, streams)

