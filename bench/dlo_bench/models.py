"""Tiny diffusion transformers for tests, the demo and the benchmarks.

Owns the tiny configurations of three real diffusers DiT classes (Flux, SD3, Wan), their
deterministic example inputs, and writing a model in the diffusers checkpoint layout. Called by
the runtime tests, the host-storage tests, the loader tests, the demo and `dlo bench runtime`.
It must not reach a model hub: weights are random, drawn from a fixed seed, so every process
that asks for the same model gets the same bytes.

The shapes are chosen so that each model exercises a different part of the backend:
Flux has two block lists of different classes and sizes (heterogeneous blocks, odd count by
default), SD3 has dual-attention blocks followed by plain ones and a smaller last block, and Wan
in bfloat16 keeps its norms and modulation tables in float32 (blocks of mixed dtypes), like
diffusers' own `from_pretrained` does.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

Kind = Literal["flux", "sd3", "wan"]
KINDS: tuple[Kind, ...] = ("flux", "sd3", "wan")
DEFAULT_LAYERS = {"flux": 5, "sd3": 4, "wan": 3}
"""Streamed blocks per kind by default: Flux 2 double + 3 single (odd), SD3 4, Wan 3 (odd)."""


def tiny_model(
    kind: Kind,
    *,
    seed: int = 0,
    num_layers: int | None = None,
    dtype: torch.dtype = torch.float32,
    head_dim: int = 16,
) -> nn.Module:
    """A real diffusers transformer of `kind` with random weights from `seed`, in eval mode.

    `num_layers` is the total number of DiT blocks (for Flux: half double-stream blocks, rounded
    down, the rest single-stream). `head_dim` scales every width (benchmarks raise it so that
    compute per block is not negligible). Parameters are `dtype`, except the modules the class
    keeps in float32 (Wan's norms and modulation tables).
    """
    if kind not in KINDS:
        raise ValueError(f"unknown model kind {kind!r}; expected one of {', '.join(KINDS)}")
    layers = DEFAULT_LAYERS[kind] if num_layers is None else num_layers
    if layers < 1:
        raise ValueError(f"num_layers={layers} must be 1 or more")
    if head_dim < 16 or head_dim % 16:
        raise ValueError(f"head_dim={head_dim} must be a positive multiple of 16")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _BUILDERS[kind](layers, head_dim)
    model.eval()
    _cast(model, dtype)
    return model


def _flux(layers: int, head_dim: int) -> nn.Module:
    from diffusers import FluxTransformer2DModel

    eighth = head_dim // 8
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=layers // 2,
        num_single_layers=layers - layers // 2,
        attention_head_dim=head_dim,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=(2 * eighth, 3 * eighth, 3 * eighth),
    )


def _sd3(layers: int, head_dim: int) -> nn.Module:
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        num_layers=layers,
        attention_head_dim=head_dim,
        num_attention_heads=2,
        joint_attention_dim=32,
        caption_projection_dim=2 * head_dim,
        pooled_projection_dim=32,
        out_channels=4,
        pos_embed_max_size=16,
        dual_attention_layers=tuple(range(layers // 2)),
        qk_norm="rms_norm",
    )


def _wan(layers: int, head_dim: int) -> nn.Module:
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=head_dim,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=32,
        ffn_dim=4 * head_dim,
        num_layers=layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )


_BUILDERS = {"flux": _flux, "sd3": _sd3, "wan": _wan}


def _cast(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast to `dtype`, keeping the class's `_keep_in_fp32_modules` in float32.

    Calls `nn.Module.to` directly: diffusers' own `to` logs a warning about exactly the modules
    this function keeps in float32.
    """
    if dtype == torch.float32:
        return
    nn.Module.to(model, dtype)
    keep = getattr(model, "_keep_in_fp32_modules", None) or ()
    for name, module in model.named_modules():
        if any(part in keep for part in name.split(".")):
            nn.Module.to(module, torch.float32)
    for name, param in model.named_parameters():
        if name.split(".")[-1] in keep:
            param.data = param.data.float()


def example_inputs(
    kind: Kind, model: nn.Module, *, seed: int = 0, batch: int = 1, side: int = 8
) -> dict[str, Any]:
    """Forward keyword arguments for `model` (built by `tiny_model(kind)`), drawn from `seed`.

    `side` is the latent's height and width (Flux: `(side/2)**2` image tokens; SD3 at most 32).
    Tensors are on the model's device, in the dtype of its `proj_out` weight. `return_dict` is
    False, so `model(**inputs)[0]` is the output tensor.
    """
    config = model.config
    param = model.proj_out.weight
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=param.device, dtype=param.dtype)

    timestep = torch.full((batch,), 500.0, device=param.device, dtype=param.dtype)
    if kind == "flux":
        height = width = side // 2
        txt = 6
        img_ids = torch.zeros(height, width, 3)
        img_ids[..., 1] = torch.arange(height)[:, None]
        img_ids[..., 2] = torch.arange(width)[None, :]
        return {
            "hidden_states": rand(batch, height * width, config.in_channels),
            "encoder_hidden_states": rand(batch, txt, config.joint_attention_dim),
            "pooled_projections": rand(batch, config.pooled_projection_dim),
            "timestep": timestep / 1000,
            "img_ids": img_ids.reshape(-1, 3).to(param.device),
            "txt_ids": torch.zeros(txt, 3, device=param.device),
            "return_dict": False,
        }
    if kind == "sd3":
        return {
            "hidden_states": rand(batch, config.in_channels, side, side),
            "encoder_hidden_states": rand(batch, 6, config.joint_attention_dim),
            "pooled_projections": rand(batch, config.pooled_projection_dim),
            "timestep": timestep,
            "return_dict": False,
        }
    if kind == "wan":
        return {
            "hidden_states": rand(batch, config.in_channels, 2, side, side),
            "encoder_hidden_states": rand(batch, 6, config.text_dim),
            "timestep": timestep,
            "return_dict": False,
        }
    raise ValueError(f"unknown model kind {kind!r}; expected one of {', '.join(KINDS)}")


def save_diffusers_layout(
    model: nn.Module, directory: str | Path, *, max_shard_bytes: int | None = None
) -> Path:
    """Write `model` as `<directory>/transformer/` with `config.json` and safetensors weights.

    With `max_shard_bytes` the weights are split into several files plus
    `diffusion_pytorch_model.safetensors.index.json`, as diffusers does for large checkpoints.
    Returns the `transformer` directory.
    """
    target = Path(directory) / "transformer"
    kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_bytes is not None:
        kwargs["max_shard_size"] = max_shard_bytes
    model.save_pretrained(target, **kwargs)
    return target


def save_skewed_layout(model: nn.Module, directory: str | Path, skew: int) -> Path:
    """Write `model` as `<directory>/transformer/` in diffusers' sharded layout, one tensor per
    file, each tensor's data `skew` bytes past a boundary of its file that
    `dlo_runtime.layout.ALIGN_BYTES` (64, a fresh CPU allocation's) divides (the header is
    padded with spaces to put it there, as the format allows). Returns the `transformer`
    directory. A checkpoint whose every tensor lies off the alignment compute expects, by
    construction, whatever the tensors' sizes."""
    from dlo_runtime.checkpoint_plan import INDEX_NAME
    from dlo_runtime.layout import ALIGN_BYTES
    from dlo_runtime.mapping import SAFETENSORS_DTYPES

    names = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
    target = Path(directory) / "transformer"
    model.save_config(target)
    weight_map = {}
    for index, (name, tensor) in enumerate(sorted(model.state_dict().items())):
        file = f"part-{index:05d}.safetensors"
        header = json.dumps({name: {"dtype": names[tensor.dtype], "shape": list(tensor.shape),
                                    "data_offsets": [0, tensor.nbytes]}}).encode()
        header += b" " * ((skew - 8 - len(header)) % ALIGN_BYTES)
        data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        (target / file).write_bytes(struct.pack("<Q", len(header)) + header + data)
        weight_map[name] = file
    (target / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return target
