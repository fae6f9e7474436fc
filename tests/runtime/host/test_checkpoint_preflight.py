"""Checkpoint preflight: which entries may back a weightless DiT, and the exact reason when not."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from diffusers import FluxTransformer2DModel
from support.host_helpers import settings_with, state_equal
from safetensors.torch import save_file
from torch import nn

from dlo_runtime.checkpoint_plan import build_meta_dit, initializers, parameters_on_meta, preflight
from dlo_runtime.host_weight_plan import BackingKind, DeclaredTransform

WEIGHTS = "diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def meta_flux(flux_layout: Path) -> nn.Module:
    return build_meta_dit(FluxTransformer2DModel, flux_layout / "transformer", torch.float32)


def component_entry(tmp_path: Path, flux_layout: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """An entry whose transformer folder holds `tensors` in one file."""
    folder = tmp_path / "entry" / "transformer"
    folder.mkdir(parents=True)
    shutil.copyfile(flux_layout / "transformer" / "config.json", folder / "config.json")
    save_file(tensors, folder / WEIGHTS)
    return tmp_path / "entry"


def reason(entry: Path, dit: nn.Module, **fields: object) -> str | None:
    return preflight(entry, dit, settings_with(**fields)).reason


def test_meta_build_initializes_nothing_and_restores_torch_init(
        flux_layout: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A meta tensor holds no values: `reset_parameters`' init calls are skipped while the DiT is
    built (they cost a cold start ~0.1 s), and `torch.nn.init` is whole again afterwards."""
    calls = []
    original = nn.init.kaiming_uniform_
    monkeypatch.setattr(nn.init, "kaiming_uniform_",
                        lambda tensor, *a, **k: calls.append(tensor.shape) or original(
                            tensor, *a, **k))
    counting = nn.init.kaiming_uniform_
    build_meta_dit(FluxTransformer2DModel, flux_layout / "transformer", torch.float32)
    assert calls == [] and nn.init.kaiming_uniform_ is counting
    nn.Linear(2, 2)
    assert calls == [torch.Size([2, 2])]


def test_every_initializer_torch_has_is_skipped_while_building() -> None:
    """The in-place initializers are read from `torch.nn.init` itself, so none a release adds is
    missed (`eye_` and `dirac_` were, in a hand-kept list): each leaves its tensor untouched."""
    found = initializers()
    assert {"kaiming_uniform_", "normal_", "eye_", "dirac_", "uniform"} <= set(found)
    assert "calculate_gain" not in found
    with parameters_on_meta():
        for name in found:
            tensor = torch.full((3, 3, 3), 7.0)
            assert getattr(nn.init, name)(tensor) is tensor, name
            assert torch.equal(tensor, torch.full((3, 3, 3), 7.0)), name
    assert all(getattr(nn.init, name) is function for name, function in found.items())


def test_meta_build_allocates_no_weights(meta_flux: nn.Module, flux: nn.Module) -> None:
    assert all(p.is_meta for p in meta_flux.parameters())
    assert {n: p.shape for n, p in meta_flux.named_parameters()} == {
        n: p.shape for n, p in flux.named_parameters()}


def test_sharded_entry_is_accepted_with_zero_copy_views(
        flux_layout: Path, meta_flux: nn.Module, flux: nn.Module) -> None:
    result = preflight(flux_layout, meta_flux, settings_with(), skips_ordinary_load=True)
    plan = result.plan
    assert result.reason is None and plan is not None
    assert plan.backing_kind is BackingKind.CHECKPOINT
    assert plan.covered_prefixes == ("transformer/",)
    assert len({b.file for b in plan.bindings}) == 3
    tensors = plan.take_tensors()
    assert state_equal(tensors, flux.state_dict())
    binding = plan.bindings[0]
    first = tensors[binding.name]
    # A view shares the mapping: the next byte of the same file is reachable from its storage.
    assert first.untyped_storage().nbytes() == (flux_layout / binding.file).stat().st_size
    plan.close()


def test_single_component_file_is_accepted(
        tmp_path: Path, flux_layout: Path, meta_flux: nn.Module, flux: nn.Module) -> None:
    entry = component_entry(tmp_path, flux_layout, flux.state_dict())
    plan = preflight(entry, meta_flux, settings_with()).plan
    assert plan is not None and plan.covered_prefixes == ("transformer/",)
    assert state_equal(plan.take_tensors(), flux.state_dict())
    plan.close()


def test_single_file_checkpoint_at_the_root_is_accepted(
        tmp_path: Path, meta_flux: nn.Module, flux: nn.Module) -> None:
    save_file(flux.state_dict(), tmp_path / "flux-tiny.safetensors")
    plan = preflight(tmp_path, meta_flux, settings_with()).plan
    assert plan is not None and plan.covered_prefixes == ("flux-tiny.safetensors",)
    plan.close()


def test_missing_tensor(tmp_path: Path, flux_layout: Path, meta_flux: nn.Module,
                        flux: nn.Module) -> None:
    state = flux.state_dict()
    del state["proj_out.bias"]
    entry = component_entry(tmp_path, flux_layout, state)
    assert reason(entry, meta_flux) == (
        "missing tensor: 'proj_out.bias' has no source in the checkpoint")


def test_shape_mismatch(tmp_path: Path, flux_layout: Path, meta_flux: nn.Module,
                        flux: nn.Module) -> None:
    state = flux.state_dict()
    state["proj_out.bias"] = torch.zeros(5)
    entry = component_entry(tmp_path, flux_layout, state)
    assert reason(entry, meta_flux) == (
        "shape mismatch for 'proj_out.bias': checkpoint [5] in "
        f"transformer/{WEIGHTS}, runtime [4]")


def test_dtype_mismatch(tmp_path: Path, flux_layout: Path, meta_flux: nn.Module,
                        flux: nn.Module) -> None:
    state = flux.state_dict()
    state["proj_out.bias"] = state["proj_out.bias"].bfloat16()
    entry = component_entry(tmp_path, flux_layout, state)
    assert reason(entry, meta_flux) == (
        "dtype mismatch for 'proj_out.bias': checkpoint torch.bfloat16 in "
        f"transformer/{WEIGHTS}, runtime torch.float32")


def test_declared_transform_accepts_a_stored_layout(
        tmp_path: Path, flux_layout: Path, meta_flux: nn.Module, flux: nn.Module) -> None:
    state = flux.state_dict()
    state["proj_out.weight"] = state["proj_out.weight"].reshape(-1).clone()
    entry = component_entry(tmp_path, flux_layout, state)
    shape = tuple(flux.proj_out.weight.shape)
    assert reason(entry, meta_flux).startswith("shape mismatch for 'proj_out.weight'")
    plan = preflight(entry, meta_flux, settings_with(),
                     transforms=[DeclaredTransform(name="proj_out.weight", shape=shape)]).plan
    assert plan is not None
    assert torch.equal(plan.take_tensors()["proj_out.weight"], flux.proj_out.weight)
    plan.close()


def test_tensor_parallelism(flux_layout: Path, meta_flux: nn.Module) -> None:
    assert reason(flux_layout, meta_flux, **{"parallel.tp": 2}) == (
        "tensor parallelism is on (parallel.tp=2); each rank holds a slice, not the stored "
        "tensors")


def test_hsdp(flux_layout: Path, meta_flux: nn.Module) -> None:
    assert reason(flux_layout, meta_flux, **{"parallel.hsdp": True}) == (
        "HSDP is on (parallel.hsdp=true); it owns parameter sharding")


def test_online_quantization(flux_layout: Path, meta_flux: nn.Module) -> None:
    assert reason(flux_layout, meta_flux, quantization="fp8_per_tensor") == (
        "online quantization is on (quantization='fp8_per_tensor'); the runtime tensors differ "
        "from the stored ones")


def test_registration_budget_prefers_the_runtime_cache(flux_layout: Path,
                                                       meta_flux: nn.Module) -> None:
    assert reason(flux_layout, meta_flux, **{
        "offload.use_allgather": False, "offload.runtime_cache_pin_limit_gib": 1.5}) == (
        "offload.runtime_cache_pin_limit_gib=1.5 selects the runtime cache, whose final tensors "
        "can be registered")


def test_mixed_source_falls_back_as_a_unit(tmp_path: Path, meta_flux: nn.Module,
                                           flux: nn.Module) -> None:
    state = dict(flux.state_dict())
    state["text_encoder.embed.weight"] = torch.zeros(3, 2)
    save_file(state, tmp_path / "all-in-one.safetensors")
    assert reason(tmp_path, meta_flux) == (
        "mixed source: all-in-one.safetensors also holds 'text_encoder.embed.weight', which is "
        "not a DiT tensor; the file cannot be skipped as a unit")


def test_tensor_with_two_sources(tmp_path: Path, flux_layout: Path, meta_flux: nn.Module) -> None:
    entry = tmp_path / "entry"
    shutil.copytree(flux_layout, entry)
    folder = entry / "transformer"
    shard = sorted(folder.glob("*-00001-of-*.safetensors"))[0]
    extra = folder / "extra.safetensors"
    shutil.copyfile(shard, extra)
    index = (folder / f"{WEIGHTS}.index.json")
    index.write_text(index.read_text().replace('"weight_map": {',
                                               '"weight_map": {"extra": "extra.safetensors", '))
    found = reason(entry, meta_flux)
    assert found.startswith("tensor ") and found.endswith(
        f" has more than one source: transformer/{shard.name} and transformer/extra.safetensors")


def test_no_weights(tmp_path: Path, meta_flux: nn.Module) -> None:
    assert reason(tmp_path, meta_flux) == (
        "no safetensors weights for component 'transformer': expected "
        f"transformer/{WEIGHTS}.index.json, transformer/{WEIGHTS} or one *.safetensors file at "
        "the entry root, found 0 there")
