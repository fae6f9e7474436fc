"""Shared by the runtime tests and their worker processes: settings, reference outputs, and one
offloaded forward with the figures the tests check."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dlo_bench.models import example_inputs, tiny_model
from dlo_runtime.backend import DistributedLayerwiseOffloadBackend, host_bytes
from dlo_runtime.host_weight_plan import (
    BackingKind,
    HostWeightPlan,
    TensorBinding,
    runtime_tensors,
)
from dlo_contract.settings import OffloadConfig, ParallelConfig, Settings
from dlo_runtime.streams import StreamSet
from dlo_runtime.transfer import ShardStore


def offload_settings(
    *, use_allgather: bool = True, dp: int = 1, sp: int = 1, resident_layers: int = 0
) -> Settings:
    return Settings(
        offload=OffloadConfig(use_allgather=use_allgather, resident_layers=resident_layers),
        parallel=ParallelConfig(dp=dp, sp=sp),
    )


RANK_LOCAL = offload_settings(use_allgather=False)
"""Rank-local mode: every rank streams whole blocks, no group (the single-process tests)."""


def forward(model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs)[0]


class DictMapping:
    """Stands for a mapped entry: hands out views of fixed tensors. Closing empties them, as
    unmapping would, so a backend that reads a view after release fails loudly."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.closed = False

    def view(self, binding: TensorBinding) -> torch.Tensor:
        return self.tensors[binding.name]

    def close(self) -> None:
        for tensor in self.tensors.values():
            tensor.data = torch.empty(0, dtype=tensor.dtype)
        self.closed = True


def mapped_plan(model: torch.nn.Module) -> tuple[HostWeightPlan, DictMapping]:
    tensors = {name: t.detach().clone() for name, t in runtime_tensors(model).items()}
    mapping = DictMapping(tensors)
    bindings = [
        TensorBinding(name=name, file="w.safetensors", offset=0, dtype=t.dtype,
                      shape=tuple(t.shape))
        for name, t in tensors.items()
    ]
    plan = HostWeightPlan(
        backing_kind=BackingKind.CHECKPOINT, bindings=bindings, source=mapping,
        skips_ordinary_load=True,
    )
    return plan, mapping


def strip_parameters(model: torch.nn.Module) -> None:
    """Move every parameter to the meta device, as a loader that skipped the DiT leaves it."""
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                module._parameters[name] = torch.nn.Parameter(
                    param.to("meta"), requires_grad=param.requires_grad
                )


def shard_storages(backend: DistributedLayerwiseOffloadBackend) -> dict[str, int]:
    """Distinct storages behind all blocks' shards, and the dtypes among them."""
    source = backend._source
    assert isinstance(source, ShardStore)
    shards = [shard for block in source.shards for shard in block.values()]
    return {
        "shard_storages": len({shard.untyped_storage().data_ptr() for shard in shards}),
        "shard_dtypes": len({shard.dtype for shard in shards}),
    }


@dataclass
class Outcome:
    """What one offloaded run showed, in plain values so that worker processes can send it."""

    equal: bool
    equal_second_step: bool
    equal_after_disable: bool
    host_bytes: int
    streamed_bytes: int
    slot_bytes: int
    largest_block_bytes: int
    largest_block_tensor_bytes: int
    shard_count: int
    mode: str
    shard_storages: int
    """Distinct host storages behind every block's shards: one arena per dtype."""
    shard_dtypes: int


def run_case(
    kind: str,
    settings: Settings,
    *,
    dtype: torch.dtype = torch.float32,
    num_layers: int | None = None,
    group: dist.ProcessGroup | None = None,
    host_plan: Any = None,
    seed: int = 0,
    streams: StreamSet | None = None,
) -> Outcome:
    """Resident forward, then two offloaded forwards and one after disable, on copies of one
    seeded model; returns whether all are bit-identical and the memory figures. `streams` (an
    `AsyncStreamSet`, entered here) replaces the backend's in-order CPU streams."""
    reference = tiny_model(kind, seed=seed, num_layers=num_layers, dtype=dtype)
    inputs = example_inputs(kind, reference, seed=seed)
    expected = forward(reference, inputs)
    model = tiny_model(kind, seed=seed, num_layers=num_layers, dtype=dtype)
    if host_plan is not None:
        strip_parameters(model)
    with streams if streams is not None else contextlib.nullcontext():
        backend = DistributedLayerwiseOffloadBackend(
            model, settings=settings, device="cpu", group=group, host_plan=host_plan,
            streams=streams,
        )
        with backend:
            first = forward(model, inputs)
            second = forward(model, inputs)
            figures = dict(
                host_bytes=host_bytes(backend.host_tensors()),
                streamed_bytes=backend.streamed_bytes,
                slot_bytes=backend.slot_bytes,
                largest_block_bytes=max(layout.nbytes for layout in backend.layouts),
                largest_block_tensor_bytes=max(layout.tensor_bytes for layout in backend.layouts),
                shard_count=backend.shard_count,
                mode=backend.mode,
                **shard_storages(backend),
            )
        after = forward(model, inputs)
    return Outcome(
        equal=torch.equal(first, expected),
        equal_second_step=torch.equal(second, expected),
        equal_after_disable=torch.equal(after, expected),
        **figures,
    )
