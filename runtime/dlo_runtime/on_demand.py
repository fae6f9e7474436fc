"""Modules outside the block lists that are on the device only while they run.

Owns `OnDemandModules`: the whole tensors of the plan's `on_demand` modules (a large embedding, a
refiner that runs once per request), packed into one host arena per dtype (page-locked on CUDA;
see [Note: host arena] in `dlo_runtime.transfer`), and one pair of forward hooks per module.
Before a module runs, its tensors are copied into fresh device buffers (one per dtype) and
repointed into them; after it runs they get placeholders back and the buffers return to the
device allocator. A module that raises keeps its device copy until it next runs or DLO is
disabled.

The copies are issued on the compute stream, in order with the module's kernels: such a module
runs once or a few times per request, too rarely to earn a slot and a prefetch of its own. In
AllGather mode these modules stay rank-local: every rank keeps their whole tensors and no
collective is issued, so they never enter [Note: collective order] in `dlo_runtime.hooks`.

Called by the backend, which builds it at enable (before a plan's sources may be released) and
drops it at disable. It must not touch the streamed blocks, their slots or the process group.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from dlo_runtime.compiled import outside_compiled_graphs
from dlo_runtime.layout import BlockLayout, views
from dlo_runtime.streams import StreamSet
from dlo_runtime.tensors import place_placeholders, restore_device
from dlo_runtime.transfer import host_arena


class OnDemandModules:
    """Host copies and hooks of the on-demand modules of one DiT."""

    def __init__(
        self,
        layouts: Sequence[BlockLayout],
        tensors: Sequence[Sequence[torch.Tensor]],
        sources: Mapping[str, torch.Tensor],
        streams: StreamSet,
    ) -> None:
        self.layouts = layouts
        """One single-shard layout per module, in the plan's order."""
        self.tensors = tensors
        """Per module, the Parameter and buffer objects, in layout order."""
        self.streams = streams
        self.arena, self.host = host_arena(streams, [layout.numels for layout in layouts])
        """`host[module][dtype]`: the module's packed tensors, a view into `arena`."""
        for layout, flats in zip(layouts, self.host):
            for view, entry in zip(views(layout, flats), layout.entries):
                view.copy_(sources[entry.meta.name])
        self.devices, self.placeholders = place_placeholders(
            [list(group) for group in tensors],
            [[entry.meta.dtype for entry in layout.entries] for layout in layouts],
            streams.device,
        )
        self.handles: list[RemovableHandle] = []

    @property
    def tensor_bytes(self) -> int:
        """Bytes of the on-demand tensors themselves, without padding."""
        return sum(layout.tensor_bytes for layout in self.layouts)

    def host_tensors(self) -> list[torch.Tensor]:
        return list(self.arena)

    def attach(self, modules: Sequence[nn.Module]) -> None:
        """Install the hooks; `modules` in the same order as the layouts."""
        for index, module in enumerate(modules):
            self.handles += [
                module.register_forward_pre_hook(partial(self._before, index)),
                module.register_forward_hook(partial(self._after, index)),
            ]

    def detach(self) -> None:
        """Remove the hooks and drop any device copy a failed forward left behind."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        for index in range(len(self.layouts)):
            self.release(index)

    def bring(self, index: int) -> None:
        """Copy module `index` to the device and point its tensors at the copy."""
        layout = self.layouts[index]
        device = self.streams.device
        flats = {
            dtype: torch.empty(size, dtype=dtype, device=device)
            for dtype, size in layout.numels.items()
        }
        for dtype, flat in flats.items():
            # Current (compute) stream: the module's kernels are queued after this copy, and the
            # allocator reuses the buffers only for work queued after those kernels.
            flat.copy_(self.host[index][dtype], non_blocking=True)
        for tensor, view in zip(self.tensors[index], views(layout, flats)):
            tensor.data = view

    def release(self, index: int) -> None:
        """Point module `index`'s tensors at placeholders; its device buffers are freed."""
        for tensor, placeholder in zip(self.tensors[index], self.placeholders[index]):
            tensor.data = placeholder

    def restore(self) -> None:
        """Give every tensor its own storage back on the device it had before enable."""
        for layout, flats, tensors, devices in zip(
            self.layouts, self.host, self.tensors, self.devices
        ):
            for tensor, view, device in zip(tensors, views(layout, flats), devices):
                tensor.data = view.to(restore_device(device), copy=True)

    @outside_compiled_graphs
    def _before(self, index: int, module: nn.Module, args: Any) -> None:
        self.bring(index)

    @outside_compiled_graphs
    def _after(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        self.release(index)
