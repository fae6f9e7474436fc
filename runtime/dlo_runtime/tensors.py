"""Bookkeeping of a DiT's tensors for DLO: which are streamed, their sources, their placement.

Owns the split of the DiT's parameters and buffers into streamed ones (per block, in layout order),
on-demand ones (per module) and resident ones, the check that a host weight plan covers exactly the
DiT's tensors, and the repointing done once at enable and disable (resident tensors to the device,
streamed ones to placeholders, and back). Called by the backend; the per-block repointing of the
hot path lives in `dlo_runtime.hooks`. It must not allocate slots or issue transfers.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from torch import nn

from dlo_runtime.discovery import DiscoveredModel
from dlo_runtime.layout import BlockLayout, TensorMeta, build_layout
from dlo_runtime.errors import OffloadError


def restore_device(device: torch.device) -> torch.device:
    """Where a tensor goes back at disable: its device before enable; the host for meta ones."""
    return torch.device("cpu") if device.type == "meta" else device


def _named_tensors(module: nn.Module, prefix: str) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """(name, tensor, persistent) for every parameter and buffer under every name it has, so
    that a tensor tied across modules is seen from each of them."""
    for name, param in module.named_parameters(prefix=prefix, remove_duplicate=False):
        yield name, param, True
    for owner_name, owner in module.named_modules(prefix=prefix, remove_duplicate=False):
        for name, buffer in owner._buffers.items():
            if buffer is not None:
                persistent = name not in owner._non_persistent_buffers_set
                yield f"{owner_name}.{name}" if owner_name else name, buffer, persistent


def _owned(
    modules: list[tuple[str, nn.Module]], owners: dict[int, str]
) -> tuple[list[list[str]], list[list[torch.Tensor]]]:
    """Names and objects of the persistent tensors of each module (each object once per module),
    recorded in `owners`; a tensor another module owns already is refused."""
    all_names, all_tensors = [], []
    for path, module in modules:
        names, tensors = [], []
        for name, tensor, persistent in _named_tensors(module, path):
            owner = owners.get(id(tensor))
            if owner is not None and owner != path:
                raise _shared_error(name, owner)
            if persistent and owner is None:
                owners[id(tensor)] = path
                names.append(name)
                tensors.append(tensor)
        all_names.append(names)
        all_tensors.append(tensors)
    return all_names, all_tensors


def _shared_error(name: str, owner: str) -> OffloadError:
    return OffloadError(
        f"{name} shares its tensor with {owner}; DLO moves each tensor off the device with "
        "exactly one block or on-demand module",
        hint="untie the weights, or keep that module resident",
    )


class ModelTensors:
    """The DiT's tensors, split by placement, with what enable changed about them."""

    def __init__(self, model: DiscoveredModel) -> None:
        self.dit = model.dit
        # id of each streamed or on-demand tensor -> path of the block or module owning it
        owners: dict[int, str] = {}
        self.streamed_names, self.streamed_tensors = _owned(
            [(block.path, block.module) for block in model.streamed], owners
        )
        self.on_demand_names, self.on_demand_tensors = _owned(
            [(entry.path, entry.module) for entry in model.on_demand], owners
        )
        self.streamed_devices: list[list[torch.device]] = []
        self.placeholders: list[list[torch.Tensor]] = []
        self.resident: list[tuple[str, torch.Tensor, bool]] = []
        resident_ids: set[int] = set()
        for name, tensor, persistent in _named_tensors(model.dit, ""):
            owner = owners.get(id(tensor))
            if owner is not None and not name.startswith(owner + "."):
                raise _shared_error(name, owner)
            if owner is None and id(tensor) not in resident_ids:
                resident_ids.add(id(tensor))
                self.resident.append((name, tensor, persistent))
        self.resident_devices: list[torch.device] = []

    def sources(self, planned: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """Host source of each persistent tensor: the plan's, or the tensor's current data."""
        if planned is None:
            return {name: tensor.data for name, tensor in self._moved()} | {
                name: tensor.data for name, tensor, persistent in self.resident if persistent
            }
        expected = {name for name, _ in self._moved()}
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

    def _moved(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of every streamed and on-demand tensor."""
        for names, tensors in zip(
            [*self.streamed_names, *self.on_demand_names],
            [*self.streamed_tensors, *self.on_demand_tensors],
        ):
            yield from zip(names, tensors)

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
        self.on_demand_tensors = [
            [swaps.get(id(t), t) for t in tensors] for tensors in self.on_demand_tensors
        ]
        self.resident = [(n, swaps.get(id(t), t), p) for n, t, p in self.resident]

    @staticmethod
    def layouts(
        paths: list[str],
        names: list[list[str]],
        sources: Mapping[str, torch.Tensor],
        shard_count: int,
        align_bytes: int,
    ) -> list[BlockLayout]:
        """Flat per-dtype layout of each block or module (`paths`, with its tensors' `names`),
        from the shapes and dtypes of the tensors' sources."""
        return [
            build_layout(
                path,
                [TensorMeta(n, tuple(sources[n].shape), sources[n].dtype) for n in group],
                shard_count,
                align_bytes,
            )
            for path, group in zip(paths, names)
        ]

    def place_resident(self, sources: Mapping[str, torch.Tensor], device: torch.device) -> None:
        """Move every tensor outside the streamed blocks and on-demand modules to `device`,
        each with a storage of its own: a view would keep its whole source alive (a plan's
        mapping, or the file mapping that an ordinary `from_pretrained` load leaves behind)."""
        self.resident_devices = [tensor.device for _, tensor, _ in self.resident]
        for name, tensor, persistent in self.resident:
            source = sources[name] if persistent else tensor.data
            tensor.data = source.to(device, copy=True)

    def place_streamed_placeholders(
        self, device: torch.device, dtypes: list[list[torch.dtype]]
    ) -> None:
        """Point every streamed tensor at an empty tensor of its dtype on `device`."""
        self.streamed_devices, self.placeholders = place_placeholders(
            self.streamed_tensors, dtypes, device
        )

    def restore_resident(self) -> None:
        """Move the resident tensors back where they were before enable."""
        for (_, tensor, _), device in zip(self.resident, self.resident_devices):
            tensor.data = tensor.data.to(restore_device(device))


def place_placeholders(
    groups: list[list[torch.Tensor]], dtypes: list[list[torch.dtype]], device: torch.device
) -> tuple[list[list[torch.device]], list[list[torch.Tensor]]]:
    """Point each tensor of `groups` at an empty tensor of its dtype on `device`; returns the
    devices the tensors had (for disable) and the placeholders (for the hooks)."""
    empty: dict[torch.dtype, torch.Tensor] = {}
    devices, placeholders = [], []
    for tensors, group_dtypes in zip(groups, dtypes):
        devices.append([tensor.device for tensor in tensors])
        row = []
        for tensor, dtype in zip(tensors, group_dtypes):
            placeholder = empty.setdefault(dtype, torch.empty(0, dtype=dtype, device=device))
            tensor.data = placeholder
            row.append(placeholder)
        placeholders.append(row)
    return devices, placeholders


def _few(names: list[str]) -> str:
    if not names:
        return "none"
    shown = ", ".join(names[:3])
    return f"{shown} and {len(names) - 3} more" if len(names) > 3 else shown
