"""The DLO backend on CUDA: offloaded forwards equal the resident model on the same device bit
for bit, and the copy of block i+1 runs while block i computes (it is not serialized)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from dlo_bench.models import example_inputs, tiny_model
from dlo_runtime.backend import DistributedLayerwiseOffloadBackend
from dlo_runtime.host_weight_plan import HostWeightPlan, runtime_tensors
from dlo_contract.settings import OffloadConfig, Settings

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
RANK_LOCAL = Settings(offload=OffloadConfig(use_allgather=False))


def to_cuda(inputs: dict[str, Any]) -> dict[str, Any]:
    return {k: v.to(CUDA) if torch.is_tensor(v) else v for k, v in inputs.items()}


def forward(model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["flux", "sd3", "wan"])
def test_offloaded_forward_on_cuda_equals_resident(kind: str, dtype: torch.dtype) -> None:
    reference = tiny_model(kind, dtype=dtype)
    cpu_inputs = example_inputs(kind, reference)
    inputs = to_cuda(cpu_inputs)
    expected = forward(nn.Module.to(reference, CUDA), inputs)
    model = tiny_model(kind, dtype=dtype)
    with DistributedLayerwiseOffloadBackend(model, settings=RANK_LOCAL, device=CUDA) as backend:
        assert torch.equal(forward(model, inputs), expected)
        assert torch.equal(forward(model, inputs), expected)
        assert backend.slot_bytes == 2 * max(layout.nbytes for layout in backend.layouts)
        assert all(t.is_pinned() for t in backend.host_tensors())
    assert all(p.device.type == "cpu" and p.numel() > 0 for p in model.parameters())
    assert torch.equal(forward(nn.Module.to(model, CUDA), inputs), expected)


class _Mapping:
    """Stands for a mapped entry that is not registered: pageable views."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def view(self, binding: Any) -> torch.Tensor:
        return self.tensors[binding.name]

    def close(self) -> None:
        self.tensors = {}


def test_mapped_plan_through_pinned_staging_on_cuda_equals_resident() -> None:
    from dlo_runtime.host_weight_plan import BackingKind, TensorBinding

    reference = tiny_model("flux", dtype=torch.bfloat16)
    inputs = to_cuda(example_inputs("flux", reference))
    tensors = {n: t.detach().clone() for n, t in runtime_tensors(reference).items()}
    plan = HostWeightPlan(
        backing_kind=BackingKind.CHECKPOINT,
        bindings=[TensorBinding(name=n, file="w", offset=0, dtype=t.dtype, shape=tuple(t.shape))
                  for n, t in tensors.items()],
        source=_Mapping(tensors),
    )
    expected = forward(nn.Module.to(reference, CUDA), inputs)
    model = tiny_model("flux", dtype=torch.bfloat16, seed=9)
    backend = DistributedLayerwiseOffloadBackend(
        model, settings=RANK_LOCAL, device=CUDA, host_plan=plan
    )
    with backend:
        assert torch.equal(forward(model, inputs), expected)
        assert torch.equal(forward(model, inputs), expected)


def test_copy_of_the_next_block_overlaps_compute_of_the_current_one() -> None:
    """Blocks large enough that both a copy and a block's kernels take a visible time; the
    profiler's device timeline must show host-to-device copies running during kernels."""
    model = tiny_model("flux", num_layers=6, head_dim=256, dtype=torch.bfloat16)
    inputs = to_cuda(example_inputs("flux", model, batch=2, side=64))
    with DistributedLayerwiseOffloadBackend(model, settings=RANK_LOCAL, device=CUDA) as backend:
        forward(model, inputs)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            forward(model, inputs)
            torch.cuda.synchronize()
        blocks = len(backend.layouts)
    device_events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    copies = [e for e in device_events if "Memcpy HtoD" in e.name]
    kernels = [e for e in device_events if "Memcpy" not in e.name and "Memset" not in e.name]
    assert len(copies) >= blocks and kernels

    def overlaps(copy: Any) -> bool:
        return any(
            k.time_range.start < copy.time_range.end and copy.time_range.start < k.time_range.end
            for k in kernels
        )

    overlapping = [c for c in copies if overlaps(c)]
    assert len(overlapping) >= len(copies) // 2, (
        f"{len(overlapping)} of {len(copies)} block copies overlap a kernel: transfers and "
        "compute are serialized"
    )
