"""Enabling DLO where it cannot stream correctly is refused before anything changes, with a
message naming the module and what to do: a model DLO already streams (or left with
placeholders), diffusers group offloading or accelerate hooks, meta or empty tensors without a
host weight plan."""

from __future__ import annotations

import pytest
import torch
from diffusers.hooks import apply_group_offloading
from support.runtime_helpers import RANK_LOCAL, forward, strip_parameters

import dlo_runtime
from dlo_bench.models import example_inputs, tiny_model
from dlo_runtime.backend import DistributedLayerwiseOffloadBackend
from dlo_runtime.tensors import OffloadError


def backend(model: torch.nn.Module) -> DistributedLayerwiseOffloadBackend:
    return DistributedLayerwiseOffloadBackend(model, settings=RANK_LOCAL, device="cpu")


def refusal(model: torch.nn.Module) -> OffloadError:
    with pytest.raises(OffloadError) as caught:
        backend(model).enable()
    return caught.value


def test_a_second_backend_on_an_offloaded_model_is_refused_and_the_first_keeps_working() -> None:
    reference = tiny_model("flux")
    inputs = example_inputs("flux", reference)
    model = tiny_model("flux")
    first = backend(model).enable()
    assert dlo_runtime.is_enabled(model)
    assert dlo_runtime.is_enabled(type("Pipeline", (), {"transformer": model})())
    error = refusal(model)
    assert str(error) == "FluxTransformer2DModel is already offloaded by dlo"
    assert error.hint == ("call disable() on its backend (or close() on its handle) before "
                          "enabling it again, or keep using the enabled one")
    assert torch.equal(forward(model, inputs), forward(reference, inputs))
    first.disable()
    assert not dlo_runtime.is_enabled(model)
    with backend(model):  # restored: it may be enabled again
        assert torch.equal(forward(model, inputs), forward(reference, inputs))


def test_a_model_left_with_placeholders_is_refused() -> None:
    model = tiny_model("wan")
    backend(model).enable().disable(restore=False)
    assert not dlo_runtime.is_enabled(model)
    error = refusal(model)
    assert str(error) == ("WanTransformer3DModel was disabled with restore=False, so its "
                          "streamed tensors are empty placeholders")
    assert error.hint == "load the model again, or disable with restore=True to enable it again"


def test_a_model_left_with_placeholders_refuses_its_forwards_by_name() -> None:
    """Called directly after `disable(restore=False)` (a closed handle), the DiT raises dlo's
    error before any block runs, not torch's shape error from an empty weight."""
    model = tiny_model("wan")
    backend(model).enable().disable(restore=False)
    with pytest.raises(OffloadError) as caught:
        forward(model, example_inputs("wan", tiny_model("wan")))
    assert str(caught.value) == ("WanTransformer3DModel was disabled with restore=False, so its "
                                 "streamed tensors are empty placeholders")
    assert caught.value.hint == ("load the model again, or disable with restore=True to keep "
                                 "running it")


def test_diffusers_group_offloading_is_refused_naming_the_module() -> None:
    model = tiny_model("sd3")
    apply_group_offloading(model, onload_device=torch.device("cpu"),
                           offload_type="block_level", num_blocks_per_group=1)
    error = refusal(model)
    assert str(error) == ("SD3Transformer2DModel carries diffusers offloading hooks "
                          "(group_offloading); DLO and group offloading would both move its "
                          "weights")
    assert error.hint == ("load the model without enable_group_offload()/"
                          "apply_group_offloading(), or remove the hooks "
                          "(HookRegistry.remove_hook) before enabling DLO")


class AlignDevicesHook:
    """Stands for accelerate's hook class (accelerate is not a dependency): `add_hook_to_module`
    stores the hook as `module._hf_hook`, which is what the check reads."""


def test_accelerate_hooks_are_refused_naming_the_module() -> None:
    model = tiny_model("flux")
    model.transformer_blocks[1]._hf_hook = AlignDevicesHook()
    error = refusal(model)
    assert str(error) == ("FluxTransformer2DModel.transformer_blocks.1 carries an accelerate "
                          "hook (AlignDevicesHook); DLO and accelerate offloading would both "
                          "move its weights")
    assert "remove_hook_from_module" in str(error.hint)


def test_meta_tensors_without_a_host_plan_are_refused() -> None:
    model = tiny_model("wan")
    strip_parameters(model)
    error = refusal(model)
    assert str(error) == ("WanTransformer3DModel.scale_shift_table is on the meta device and no "
                          "host weight plan backs it")
    assert error.hint == ("load the weights first (from_pretrained), or build the DiT with "
                          "pod.build_dit() and enable it with pod.enable() in a pod that ran "
                          "the loader")


def test_empty_tensors_without_a_host_plan_are_refused() -> None:
    model = tiny_model("wan")
    model.blocks[0].ffn.net[0].proj.weight.data = torch.empty(0)
    error = refusal(model)
    assert str(error) == ("WanTransformer3DModel.blocks.0.ffn.net.0.proj.weight is an empty "
                          "tensor (a placeholder with no weights) and no host weight plan "
                          "backs it")
