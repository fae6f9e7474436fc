"""Bookkeeping of a DiT's tensors for DLO: which are streamed, their sources, their placement.

Owns the split of the DiT's parameters and buffers into streamed ones (per block, in layout
order) and resident ones, the check that a host weight plan covers exactly the DiT's tensors,
and the repointing done once at enable and disable (resident tensors to the device, streamed
ones to placeholders, and back). Called by the backend; the per-block repointing of the hot path
lives in `dlo_runtime.hooks`. It must not allocate slots or issue transfers.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from torch import nn

from dlo_runtime.discovery import DiscoveredModel
from dlo_runtime.errors import PermanentError
from dlo_runtime.layout import TensorMeta


class OffloadError(PermanentError):
    """DLO cannot be enabled on this model, group or host plan as given."""


def restore_device(device: torch.device) -> torch.device:
    """Where a tensor goes back at disable: its device before enable; the host for meta ones."""
    return torch.device("cpu") if device.type == "meta" else device


def _named_tensors(module: nn.Module, prefix: str) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """(name, tensor, persistent) for every parameter and buffer, each object once."""
    for name, param in module.named_parameters(prefix=prefix):
        yield name, param, True
    for owner_name, owner in module.named_modules(prefix=prefix):
        for name, buffer in owner._buffers.items():
            if buffer is not None:
                persistent = name not in owner._non_persistent_buffers_set
                yield f"{owner_name}.{name}" if owner_name else name, buffer, persistent


class ModelTensors:
    """The DiT's tensors, split by placement, with what enable changed about them."""

    def __init__(self, model: DiscoveredModel) -> None:
        self.dit = model.dit
        self.streamed_names: list[list[str]] = []
        self.streamed_tensors: list[list[torch.Tensor]] = []
        self.streamed_devices: list[list[torch.device]] = []
        self.placeholders: list[list[torch.Tensor]] = []
        streamed_ids: dict[int, str] = {}
        for block in model.streamed:
            names, tensors, seen = [], [], set()
            for name, tensor, persistent in _named_tensors(block.module, block.path):
                if persistent and id(tensor) not in seen:
                    seen.add(id(tensor))
                    names.append(name)
                    tensors.append(tensor)
                    streamed_ids[id(tensor)] = block.path
            self.streamed_names.append(names)
            self.streamed_tensors.append(tensors)
        self.resident: list[tuple[str, torch.Tensor, bool]] = []
        resident_ids: set[int] = set()
        for name, tensor, persistent in _named_tensors(model.dit, ""):
            owner = streamed_ids.get(id(tensor))
            if owner is not None and not name.startswith(owner + "."):
                raise OffloadError(
                    f"{name} shares its tensor with block {owner}; DLO streams each tensor with "
                    "exactly one block",
                    hint="untie the weights, or keep that block resident",
                )
            if owner is None and id(tensor) not in resident_ids:
                resident_ids.add(id(tensor))
                self.resident.append((name, tensor, persistent))
        self.resident_devices: list[torch.device] = []

    def sources(self, planned: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """Host source of each persistent tensor: the plan's, or the tensor's current data."""
        if planned is None:
            return {
                name: tensor.data
                for names, tensors in zip(self.streamed_names, self.streamed_tensors)
                for name, tensor in zip(names, tensors)
            } | {name: tensor.data for name, tensor, persistent in self.resident if persistent}
        expected = {name for names in self.streamed_names for name in names}
        expected |= {name for name, _, persistent in self.resident if persistent}
        missing = sorted(expected - set(planned))
        extra = sorted(set(planned) - expected)
        if missing or extra:
            raise OffloadError(
                "the host weight plan does not match the DiT: "
                f"missing {_few(missing)}; unexpected {_few(extra)}",
                hint="the loader's plan must name every parameter and persistent buffer once",
            )
        return dict(planned)

    def replace_meta(self) -> None:
        """Give every meta tensor (a DiT built without weights for a host plan) an empty host
        storage, so that `.data` can be repointed: PyTorch refuses to repoint a meta tensor to
        a real one. The new objects replace the old in every module that holds them."""
        swaps: dict[int, torch.Tensor] = {}
        for module in self.dit.modules():
            for table in (module._parameters, module._buffers):
                for name, tensor in table.items():
                    if tensor is None or not tensor.is_meta:
                        continue
                    if id(tensor) not in swaps:
                        empty = torch.empty(0, dtype=tensor.dtype)
                        swaps[id(tensor)] = (
                            nn.Parameter(empty, requires_grad=tensor.requires_grad)
                            if isinstance(tensor, nn.Parameter)
                            else empty
                        )
                    table[name] = swaps[id(tensor)]
        if not swaps:
            return
        self.streamed_tensors = [
            [swaps.get(id(t), t) for t in tensors] for tensors in self.streamed_tensors
        ]
        self.resident = [(n, swaps.get(id(t), t), p) for n, t, p in self.resident]

    def metas(self, index: int, sources: Mapping[str, torch.Tensor]) -> list[TensorMeta]:
        """Shapes and dtypes of streamed block `index`, taken from its sources."""
        return [
            TensorMeta(name, tuple(sources[name].shape), sources[name].dtype)
            for name in self.streamed_names[index]
        ]

    def place_resident(
        self, sources: Mapping[str, torch.Tensor], device: torch.device, *, copy: bool
    ) -> None:
        """Move every tensor outside the streamed blocks to `device`.

        `copy` gives each one storage of its own, so that the plan's mappings may close."""
        self.resident_devices = [tensor.device for _, tensor, _ in self.resident]
        for name, tensor, persistent in self.resident:
            source = sources[name] if persistent else tensor.data
            tensor.data = source.to(device, copy=copy)

    def place_streamed_placeholders(
        self, device: torch.device, dtypes: list[list[torch.dtype]]
    ) -> None:
        """Point every streamed tensor at an empty tensor of its dtype on `device`."""
        empty: dict[torch.dtype, torch.Tensor] = {}
        self.streamed_devices = []
        self.placeholders = []
        for tensors, block_dtypes in zip(self.streamed_tensors, dtypes):
            self.streamed_devices.append([tensor.device for tensor in tensors])
            row = []
            for tensor, dtype in zip(tensors, block_dtypes):
                placeholder = empty.setdefault(dtype, torch.empty(0, dtype=dtype, device=device))
                tensor.data = placeholder
                row.append(placeholder)
            self.placeholders.append(row)

    def restore_resident(self) -> None:
        """Move the resident tensors back where they were before enable."""
        for (_, tensor, _), device in zip(self.resident, self.resident_devices):
            tensor.data = tensor.data.to(restore_device(device))


def _few(names: list[str]) -> str:
    if not names:
        return "none"
    shown = ", ".join(names[:3])
    return f"{shown} and {len(names) - 3} more" if len(names) > 3 else shown
