"""Tiny random-weight pipelines that `dlo serve` runs: whole diffusers model folders (DiT, VAE,
scheduler, text encoders and tokenizers, `model_index.json`) of four families, each with its own
text encoders: Flux (CLIP + T5), SD3 (two CLIPs with projection + T5), Wan text-to-video (UMT5)
and Z-Image (Qwen3).

Used by the demo, the server tests and `dlo bench serve`; weights come from fixed seeds and the
tokenizers from a fixed corpus, so every process that writes a folder writes the same bytes.
Nothing is downloaded. Must not be imported by the planes.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dlo_bench.models import tiny_model
from dlo_bench.text_models import Encoder, Tokenizer, make_encoder, make_tokenizer


class Family(str, Enum):
    """The pipeline families the tiny folders come in (their `model_index.json` class)."""

    FLUX = "FluxPipeline"
    SD3 = "StableDiffusion3Pipeline"
    WAN = "WanPipeline"
    ZIMAGE = "ZImagePipeline"


def tiny_vae(seed: int = 0, latent_channels: int = 1) -> nn.Module:
    """Two blocks (factor 2). One latent channel for Flux (its in_channels of 4 are the 2x2
    packing of the latents), four for SD3 and Z-Image."""
    from diffusers import AutoencoderKL

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=latent_channels,
                            block_out_channels=(8, 8), layers_per_block=1, norm_num_groups=4,
                            down_block_types=("DownEncoderBlock2D",) * 2,
                            up_block_types=("UpDecoderBlock2D",) * 2,
                            scaling_factor=1.0, shift_factor=0.0)
    return vae.eval()


def save_pipeline(family: Family, directory: Path, *, seed: int = 0,
                  dit: nn.Module | None = None) -> Path:
    """Write a tiny `family` pipeline to `directory` (the DiT: `dit`, else the family's tiny
    one); returns `directory`."""
    import diffusers

    pipeline = getattr(diffusers, family.value)(**components(family, seed=seed, dit=dit))
    pipeline.save_pretrained(directory, safe_serialization=True)
    return directory


def components(family: Family, *, seed: int = 0, dit: nn.Module | None = None
               ) -> dict[str, Any]:
    """The components of a tiny `family` pipeline, by the names its class takes."""
    return _BUILDERS[family](seed, dit)


def save_pipeline_layout(dit: nn.Module, directory: Path, *, seed: int = 0) -> Path:
    """A tiny Flux pipeline around `dit` (a `tiny_model("flux")`)."""
    return save_pipeline(Family.FLUX, directory, seed=seed, dit=dit)


def _flux(seed: int, dit: nn.Module | None) -> dict[str, Any]:
    from diffusers import FlowMatchEulerDiscreteScheduler

    dit = dit or tiny_model("flux", seed=seed)
    clip, t5 = make_tokenizer(Tokenizer.CLIP), make_tokenizer(Tokenizer.T5)
    return {"transformer": dit, "vae": tiny_vae(seed),
            "scheduler": FlowMatchEulerDiscreteScheduler(shift=3.0),
            "tokenizer": clip, "tokenizer_2": t5,
            "text_encoder": make_encoder(Encoder.CLIP, vocab_size=len(clip), seed=seed + 1,
                                         width=dit.config.pooled_projection_dim),
            "text_encoder_2": make_encoder(Encoder.T5, vocab_size=len(t5), seed=seed + 2,
                                           width=dit.config.joint_attention_dim)}


def _sd3(seed: int, dit: nn.Module | None) -> dict[str, Any]:
    """Two CLIPs half the pooled width each (their pooled outputs are concatenated), a T5 as
    wide as the DiT's text input (the CLIPs' hidden states are padded to it)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    dit = dit or tiny_model("sd3", seed=seed)
    half = dit.config.pooled_projection_dim // 2
    clip, t5 = make_tokenizer(Tokenizer.CLIP), make_tokenizer(Tokenizer.T5)
    clips = {f"text_encoder{suffix}": make_encoder(Encoder.CLIP_PROJECTION, vocab_size=len(clip),
                                                   width=half, projection=half, seed=seed + index)
             for index, suffix in ((1, ""), (2, "_2"))}
    return {"transformer": dit, "vae": tiny_vae(seed, latent_channels=dit.config.in_channels),
            "scheduler": FlowMatchEulerDiscreteScheduler(shift=3.0), **clips,
            "tokenizer": clip, "tokenizer_2": make_tokenizer(Tokenizer.CLIP),
            "tokenizer_3": t5,
            "text_encoder_3": make_encoder(Encoder.T5, vocab_size=len(t5), seed=seed + 3,
                                           width=dit.config.joint_attention_dim),
            "image_encoder": None, "feature_extractor": None}


def _wan(seed: int, dit: nn.Module | None) -> dict[str, Any]:
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler

    dit = dit or tiny_model("wan", seed=seed)
    channels = dit.config.in_channels
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKLWan(base_dim=3, z_dim=channels, dim_mult=[1, 1, 1, 1],
                               num_res_blocks=1, temperal_downsample=[False, True, True],
                               latents_mean=[0.0] * channels, latents_std=[1.0] * channels)
    umt5 = make_tokenizer(Tokenizer.T5)
    return {"transformer": dit, "vae": vae.eval(),
            "scheduler": FlowMatchEulerDiscreteScheduler(shift=7.0), "tokenizer": umt5,
            "text_encoder": make_encoder(Encoder.UMT5, vocab_size=len(umt5), seed=seed + 1,
                                         width=dit.config.text_dim)}


def tiny_zimage(seed: int = 0) -> nn.Module:
    """A Z-Image DiT: two main blocks and one noise and one context refiner, 32 wide."""
    from diffusers import ZImageTransformer2DModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        dit = ZImageTransformer2DModel(in_channels=4, dim=32, n_layers=2, n_refiner_layers=1,
                                       n_heads=2, n_kv_heads=2, cap_feat_dim=32,
                                       axes_dims=[8, 4, 4], axes_lens=[256, 32, 32])
    return dit.eval()


def _zimage(seed: int, dit: nn.Module | None) -> dict[str, Any]:
    from diffusers import FlowMatchEulerDiscreteScheduler

    dit = dit or tiny_zimage(seed)
    qwen = make_tokenizer(Tokenizer.QWEN)
    return {"transformer": dit, "vae": tiny_vae(seed, latent_channels=dit.config.in_channels),
            "scheduler": FlowMatchEulerDiscreteScheduler(shift=3.0), "tokenizer": qwen,
            "text_encoder": make_encoder(Encoder.QWEN3, vocab_size=len(qwen), seed=seed + 1,
                                         width=dit.config.cap_feat_dim)}


_BUILDERS = {Family.FLUX: _flux, Family.SD3: _sd3, Family.WAN: _wan, Family.ZIMAGE: _zimage}


def resident_dit(path: Path) -> nn.Module:
    """The DiT of the model folder `path` loaded whole, each tensor in a fresh (aligned)
    allocation as an offloaded DiT's slots are: the reference a served output is compared with
    (diffusers leaves loaded tensors as views at unaligned file offsets, and CPU kernels round
    differently for unaligned operands)."""
    import json

    import diffusers
    from safetensors.torch import load_file

    folder = path / "transformer"
    cls = getattr(diffusers, json.loads((folder / "config.json").read_text())["_class_name"])
    dit = cls.from_config(cls.load_config(folder)).eval()
    state = {}
    for file in sorted(folder.glob("*.safetensors")):
        state.update(load_file(file))
    dit.load_state_dict({name: tensor.clone() for name, tensor in state.items()})
    return dit


def direct_pipeline(path: Path) -> Any:
    """The model folder's own diffusers pipeline with a resident DiT (`resident_dit`): what a
    served output must equal."""
    import json

    import diffusers

    name = json.loads((path / "model_index.json").read_text())["_class_name"]
    pipeline = getattr(diffusers, name).from_pretrained(path, transformer=resident_dit(path),
                                                        low_cpu_mem_usage=False)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline
