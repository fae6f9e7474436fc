"""The cold-start benchmark's checkpoint: a ~1 GB Flux transformer in the diffusers layout.

Owns the model's shape (Flux's 19 double and 38 single blocks, narrowed to width 640 so the bf16
weights are 0.96 GiB) (or `SMALL`'s, the few MB a test runs), building it with seeded random weights straight in bf16 (no float32 copy),
writing it as `transformer/` with `config.json` and three safetensors shards plus the index, and
the first forward's inputs, the same in every configuration. The built tree is kept under a
named cache directory (ignored by git) so a rerun skips the build. Called by
`dlo_bench.coldstart` and `dlo_bench.coldstart_paths`; must not be imported by the planes.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

CONFIG: dict[str, Any] = {
    "patch_size": 1, "in_channels": 64, "num_layers": 19, "num_single_layers": 38,
    "attention_head_dim": 128, "num_attention_heads": 5, "joint_attention_dim": 512,
    "pooled_projection_dim": 256, "axes_dims_rope": [16, 56, 56], "guidance_embeds": False,
}
NAME = "flux-w640-57blocks-bf16"
SMALL: dict[str, Any] = {
    **CONFIG, "num_layers": 1, "num_single_layers": 2, "attention_head_dim": 32,
    "num_attention_heads": 2, "joint_attention_dim": 64, "pooled_projection_dim": 32,
    "axes_dims_rope": [8, 12, 12],
}
"""`--small`: three blocks of width 64 (a few MB), so that a test runs every path in seconds."""
SMALL_NAME = "flux-w64-3blocks-bf16"
SHARD_BYTES = 350 * 10**6
"""diffusers' `max_shard_size`: three shards for 0.96 GiB."""
IMAGE_SIDE = 1
"""Latent tokens per side: one image token (and one text token), so the forward costs little
beside reading the weights (bf16 matrix products are slow on CPUs without bf16 units)."""
TEXT_TOKENS = 1
SEED = 0


def model_class() -> Any:
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel


def chosen(small: bool) -> tuple[str, dict[str, Any]]:
    """The model's name and config: the ~1 GB one, or `SMALL`."""
    return (SMALL_NAME, SMALL) if small else (NAME, CONFIG)


def ensure_checkpoint(cache_dir: Path, small: bool = False) -> Path:
    """The checkpoint directory (holding `transformer/`), built once under `cache_dir` in a
    folder named after the model (`chosen`)."""
    name, config = chosen(small)
    target = cache_dir / name
    if (target / "complete.json").is_file():
        return target
    shutil.rmtree(target, ignore_errors=True)
    _build(target, config)
    (target / "complete.json").write_text(json.dumps({"config": config, "seed": SEED}) + "\n")
    return target


def _build(target: Path, config: dict[str, Any]) -> None:
    import torch

    with torch.device("meta"):
        model = model_class()(**config)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.data = param.data.to(torch.bfloat16)
            if "norm" in name and name.endswith("weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
    model.save_pretrained(target / "transformer", safe_serialization=True,
                          max_shard_size=SHARD_BYTES)


def inputs(config: Mapping[str, Any]) -> dict[str, Any]:
    """The first forward's keyword arguments for a model of `config` (bf16, CPU, seeded)."""
    import torch

    gen = torch.Generator().manual_seed(SEED + 1)
    side = IMAGE_SIDE
    img_ids = torch.zeros(side, side, 3)
    img_ids[..., 1] = torch.arange(side)[:, None]
    img_ids[..., 2] = torch.arange(side)[None, :]

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    return {
        "hidden_states": rand(1, side * side, config["in_channels"]),
        "encoder_hidden_states": rand(1, TEXT_TOKENS, config["joint_attention_dim"]),
        "pooled_projections": rand(1, config["pooled_projection_dim"]),
        "timestep": torch.full((1,), 0.5, dtype=torch.bfloat16),
        "img_ids": img_ids.reshape(-1, 3),
        "txt_ids": torch.zeros(TEXT_TOKENS, 3),
        "return_dict": False,
    }
