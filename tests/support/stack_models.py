"""Tiny diffusers DiTs with two or more block stacks and no built-in offload plan.

Each entry builds a real diffusers 0.42 transformer class with a tiny config and random weights
from a seed, and its forward keyword arguments (tensors drawn from a seed, `return_dict=False`,
so `model(**inputs)[0]` is the output). Used by the discovery tests (rank-local and AllGather)
to show that the heuristic streams every stack in the order the forward runs them. Nothing is
downloaded.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class StackModel:
    cls: str
    config: dict[str, Any]
    inputs: Callable[[nn.Module, Callable[..., torch.Tensor]], dict[str, Any]]


def _flux_ids(side: int, txt: int, axes: int = 3) -> dict[str, torch.Tensor]:
    img = torch.zeros(side, side, axes)
    img[..., 1] = torch.arange(side)[:, None]
    img[..., 2] = torch.arange(side)[None, :]
    return {"img_ids": img.reshape(-1, axes), "txt_ids": torch.zeros(txt, axes)}


def _auraflow(m: nn.Module, rand: Callable[..., torch.Tensor]) -> dict[str, Any]:
    return {"hidden_states": rand(1, 4, 8, 8), "encoder_hidden_states": rand(1, 6, 32),
            "timestep": torch.tensor([500.0])}


def _chroma(m: nn.Module, rand: Callable[..., torch.Tensor]) -> dict[str, Any]:
    return {"hidden_states": rand(1, 16, 4), "encoder_hidden_states": rand(1, 6, 32),
            "timestep": torch.tensor([0.5]), **_flux_ids(4, 6)}


def _flux_like(pooled: bool, guidance: bool = False) -> Callable[..., dict[str, Any]]:
    def inputs(m: nn.Module, rand: Callable[..., torch.Tensor]) -> dict[str, Any]:
        found = {"hidden_states": rand(1, 16, 4), "encoder_hidden_states": rand(1, 6, 32),
                 "timestep": torch.tensor([0.5]), **_flux_ids(4, 6)}
        if pooled:
            found["pooled_projections"] = rand(1, 32)
        if guidance:
            found["guidance"] = torch.tensor([3.5])
        return found
    return inputs


def _flux2(m: nn.Module, rand: Callable[..., torch.Tensor]) -> dict[str, Any]:
    return {"hidden_states": rand(1, 16, 4), "encoder_hidden_states": rand(1, 6, 32),
            "timestep": torch.tensor([0.5]), "guidance": torch.tensor([3.5]),
            **_flux_ids(4, 6, axes=4)}


def _hunyuan_video(m: nn.Module, rand: Callable[..., torch.Tensor]) -> dict[str, Any]:
    return {"hidden_states": rand(1, 4, 1, 8, 8), "timestep": torch.tensor([500]),
            "encoder_hidden_states": rand(1, 6, 32),
            "encoder_attention_mask": torch.ones(1, 6, dtype=torch.bool),
            "pooled_projections": rand(1, 16), "guidance": torch.tensor([3500.0])}


def _hunyuan_image(m: nn.Module, rand: Callable[..., torch.Tensor]) -> dict[str, Any]:
    return {"hidden_states": rand(1, 4, 8, 8), "timestep": torch.tensor([500.0]),
            "encoder_hidden_states": rand(1, 6, 32),
            "encoder_attention_mask": torch.ones(1, 6, dtype=torch.bool)}


def _lumina2(m: nn.Module, rand: Callable[..., torch.Tensor]) -> dict[str, Any]:
    return {"hidden_states": rand(1, 4, 8, 8), "timestep": torch.tensor([0.5]),
            "encoder_hidden_states": rand(1, 6, 32),
            "encoder_attention_mask": torch.ones(1, 6, dtype=torch.bool)}


def _latte(m: nn.Module, rand: Callable[..., torch.Tensor]) -> dict[str, Any]:
    return {"hidden_states": rand(1, 4, 2, 8, 8), "timestep": torch.tensor([500]),
            "encoder_hidden_states": rand(1, 6, 32)}


def _wan_vace(m: nn.Module, rand: Callable[..., torch.Tensor]) -> dict[str, Any]:
    return {"hidden_states": rand(1, 4, 2, 8, 8), "timestep": torch.tensor([500]),
            "encoder_hidden_states": rand(1, 6, 16), "control_hidden_states": rand(1, 8, 2, 8, 8)}


HEAD = {"num_attention_heads": 2, "attention_head_dim": 16}
FLUX_LIKE = {"patch_size": 1, "in_channels": 4, "num_layers": 2, "num_single_layers": 3,
             "joint_attention_dim": 32, "axes_dims_rope": (4, 6, 6), **HEAD}
STACK_MODELS: dict[str, StackModel] = {
    "auraflow": StackModel("AuraFlowTransformer2DModel", {
        "sample_size": 8, "patch_size": 2, "in_channels": 4, "num_mmdit_layers": 2,
        "num_single_dit_layers": 3, "joint_attention_dim": 32, "caption_projection_dim": 32,
        "out_channels": 4, "pos_embed_max_size": 64, **HEAD}, _auraflow),
    "chroma": StackModel("ChromaTransformer2DModel", {
        **FLUX_LIKE, "approximator_num_channels": 8, "approximator_hidden_dim": 32,
        "approximator_layers": 2}, _chroma),
    "bria": StackModel("BriaTransformer2DModel", {
        **FLUX_LIKE, "pooled_projection_dim": 32}, _flux_like(pooled=True)),
    "longcat-image": StackModel("LongCatImageTransformer2DModel", {
        **FLUX_LIKE, "pooled_projection_dim": 32}, _flux_like(pooled=False)),
    "ovis-image": StackModel("OvisImageTransformer2DModel", {
        **FLUX_LIKE, "out_channels": 4}, _flux_like(pooled=False)),
    "flux2": StackModel("Flux2Transformer2DModel", {
        **FLUX_LIKE, "axes_dims_rope": (4, 4, 4, 4), "timestep_guidance_channels": 32},
        _flux2),
    "hunyuan-video": StackModel("HunyuanVideoTransformer3DModel", {
        "in_channels": 4, "out_channels": 4, "num_layers": 2, "num_single_layers": 3,
        "num_refiner_layers": 1, "text_embed_dim": 32, "pooled_projection_dim": 16,
        "rope_axes_dim": (4, 6, 6), **HEAD}, _hunyuan_video),
    "hunyuan-image": StackModel("HunyuanImageTransformer2DModel", {
        "in_channels": 4, "out_channels": 4, "num_layers": 2, "num_single_layers": 3,
        "num_refiner_layers": 1, "text_embed_dim": 32, "rope_axes_dim": (8, 8), **HEAD},
        _hunyuan_image),
    "lumina2": StackModel("Lumina2Transformer2DModel", {
        "sample_size": 8, "patch_size": 2, "in_channels": 4, "hidden_size": 32, "num_layers": 3,
        "num_refiner_layers": 2, "num_attention_heads": 2, "num_kv_heads": 1,
        "multiple_of": 16, "axes_dim_rope": (4, 6, 6), "axes_lens": (32, 32, 32),
        "cap_feat_dim": 32}, _lumina2),
    "latte": StackModel("LatteTransformer3DModel", {
        "in_channels": 4, "out_channels": 8, "num_layers": 2, "sample_size": 8, "patch_size": 2,
        "cross_attention_dim": 32, "caption_channels": 32, "num_embeds_ada_norm": 1000,
        "norm_type": "ada_norm_single", "video_length": 2, **HEAD}, _latte),
    "wan-vace": StackModel("WanVACETransformer3DModel", {
        "in_channels": 4, "out_channels": 4, "text_dim": 16, "freq_dim": 32, "ffn_dim": 64,
        "num_layers": 4, "vace_layers": [0, 2], "vace_in_channels": 8, "rope_max_seq_len": 32,
        **HEAD}, _wan_vace),
}


def stack_model(name: str, *, seed: int = 0) -> nn.Module:
    import diffusers

    entry = STACK_MODELS[name]
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # Chroma builds the deprecated FluxPosEmbed alias itself; nothing to fix on our side.
        warnings.filterwarnings("ignore", message="`FluxPosEmbed` is deprecated",
                                category=FutureWarning)
        torch.manual_seed(seed)
        model = getattr(diffusers, entry.cls)(**entry.config)
    return model.eval()


def stack_inputs(name: str, model: nn.Module, *, seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    return {**STACK_MODELS[name].inputs(model, rand), "return_dict": False}


def run_order(model: nn.Module, inputs: dict[str, Any], paths: list[str]) -> list[str]:
    """The order in which `model`'s forward runs the modules at `paths` (each once)."""
    seen: dict[str, None] = {}
    modules = dict(model.named_modules())
    handles = [modules[path].register_forward_pre_hook(
        lambda module, args, path=path: seen.setdefault(path, None)) for path in paths]
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    return list(seen)


FULL_SIZE = {
    "latte": {"in_channels": 4, "out_channels": 8, "patch_size": 2, "num_layers": 28,
              "num_attention_heads": 16, "attention_head_dim": 72, "caption_channels": 4096,
              "cross_attention_dim": 1152, "norm_type": "ada_norm_single",
              "num_embeds_ada_norm": 1000},
}
"""Configs of the released models where the class's defaults do not build one (Latte-1)."""


def shares(model: nn.Module) -> tuple[float, float]:
    """Streamed share of `model`'s weight bytes with the largest stack alone (the heuristic before
    it took every stack) and with the lists the heuristic takes now."""
    from dlo_runtime.offload_plan import block_lists, heuristic_plan, weight_bytes

    lists = dict(block_lists(model))
    total = weight_bytes(model)
    return max(lists.values()) / total, sum(lists[p] for p in heuristic_plan(model).blocks) / total


def main() -> None:
    """Print each model's streamed share before and after, tiny and at its full default size
    (built on the meta device, so nothing is allocated)."""
    import diffusers

    for name, entry in sorted(STACK_MODELS.items()):
        tiny = shares(stack_model(name))
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            full = shares(getattr(diffusers, entry.cls)(**FULL_SIZE.get(name, {})))
        print(f"{entry.cls:34s} tiny {tiny[0]:6.1%} -> {tiny[1]:6.1%}   "
              f"full size {full[0]:6.1%} -> {full[1]:6.1%}")


if __name__ == "__main__":
    main()
