"""On-demand modules (the plan's `on_demand`): their weights stay in host memory and are on the
device only while the module runs; outputs equal the resident model bit for bit, with ordinary
weights and with a mapped host plan; tied weights that would escape the hooks are refused.
AllGather mode (rank-local on-demand copies, mappings released) runs in the gloo worker."""

from __future__ import annotations

import pytest
import torch
from support.runtime_helpers import RANK_LOCAL, forward, mapped_plan, strip_parameters
from support.runtime_models import OnDemandDiT, on_demand_inputs, seeded
from torch import nn

from dlo_runtime.backend import DistributedLayerwiseOffloadBackend, host_bytes
from dlo_runtime.tensors import OffloadError

TOKENS = on_demand_inputs()


def _tensor_bytes(*modules: nn.Module) -> int:
    """Bytes of the parameters and persistent buffers of `modules`."""
    return sum(
        t.numel() * t.element_size()
        for module in modules
        for t in module.state_dict().values()
    )


def test_on_demand_modules_are_on_the_device_only_while_they_run() -> None:
    expected = forward(seeded(OnDemandDiT), TOKENS)
    model = seeded(OnDemandDiT)
    before = {name: id(p) for name, p in model.named_parameters()}
    while_running: list[int] = []
    with DistributedLayerwiseOffloadBackend(model, settings=RANK_LOCAL, device="cpu") as backend:
        # Registered after DLO's own pre-hook, so it sees the weights DLO brought in.
        model.refiner.register_forward_pre_hook(
            lambda module, args: while_running.append(module.up.weight.numel())
        )
        assert torch.equal(forward(model, TOKENS), expected)
        assert torch.equal(forward(model, TOKENS), expected)
        with torch.inference_mode():
            assert torch.equal(forward(model, TOKENS), expected)
        assert while_running == [64 * 16] * 3
        moved = [*model.embed.parameters(), *model.refiner.parameters(), model.refiner.scale]
        assert all(t.numel() == 0 for t in moved)
        assert model.refiner.bias_cache.numel() == 16
        assert all(p.numel() > 0 for p in model.out.parameters())
        reference = seeded(OnDemandDiT)
        on_demand = _tensor_bytes(reference.embed, reference.refiner)
        assert backend._on_demand is not None and backend._on_demand.tensor_bytes == on_demand
        assert host_bytes(backend.host_tensors()) >= backend.streamed_bytes + on_demand
        assert {name: id(p) for name, p in model.named_parameters()} == before
    assert all(t.numel() > 0 for t in model.state_dict().values())
    assert not model.embed._forward_pre_hooks and not model.embed._forward_hooks
    assert torch.equal(forward(model, TOKENS), expected)


def test_on_demand_modules_from_a_mapped_plan_outlive_the_mapping() -> None:
    reference = seeded(OnDemandDiT)
    expected = forward(reference, TOKENS)
    plan, mapping = mapped_plan(reference)
    model = seeded(OnDemandDiT, seed=9)
    strip_parameters(model)
    with DistributedLayerwiseOffloadBackend(
        model, settings=RANK_LOCAL, device="cpu", host_plan=plan
    ):
        assert torch.equal(forward(model, TOKENS), expected)
        assert model.embed.weight.numel() == 0
    assert mapping.closed
    assert torch.equal(forward(model, TOKENS), expected)


def test_disable_without_restore_leaves_on_demand_placeholders() -> None:
    model = seeded(OnDemandDiT)
    backend = DistributedLayerwiseOffloadBackend(model, settings=RANK_LOCAL, device="cpu")
    backend.enable()
    forward(model, TOKENS)
    backend.disable(restore=False)
    assert all(p.numel() == 0 for p in model.refiner.parameters())
    assert host_bytes(backend.host_tensors()) == 0 and backend._on_demand is None


def test_a_module_that_raises_is_brought_in_again_on_the_next_call() -> None:
    expected = forward(seeded(OnDemandDiT), TOKENS)
    model = seeded(OnDemandDiT)
    failures = [RuntimeError("injected")]

    def fail_once(*_: object) -> None:
        if failures:
            raise failures.pop()

    with DistributedLayerwiseOffloadBackend(model, settings=RANK_LOCAL, device="cpu"):
        handle = model.refiner.norm.register_forward_pre_hook(fail_once)
        with pytest.raises(RuntimeError, match="injected"):
            forward(model, TOKENS)
        handle.remove()
        assert torch.equal(forward(model, TOKENS), expected)
        assert model.refiner.up.weight.numel() == 0


def test_a_weight_tied_outside_an_on_demand_module_is_refused() -> None:
    class Tied(OnDemandDiT):
        _dlo_offload_plan = {"blocks": ["layers"], "on_demand": ["embed"]}

        def __init__(self) -> None:
            super().__init__()
            self.unembed = nn.Linear(16, 256, bias=False)
            self.unembed.weight = self.embed.weight

    model = Tied()
    backend = DistributedLayerwiseOffloadBackend(model, settings=RANK_LOCAL, device="cpu")
    with pytest.raises(OffloadError) as caught:
        backend.enable()
    assert str(caught.value) == (
        "unembed.weight shares its tensor with embed; DLO moves each tensor off the device "
        "with exactly one block or on-demand module"
    )
    assert caught.value.hint == "untie the weights, or keep that module resident"
    assert not backend.enabled and all(p.numel() > 0 for p in model.parameters())
