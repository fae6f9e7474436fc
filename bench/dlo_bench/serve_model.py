"""A tiny random-weight Flux model folder that `dlo serve` can run: the DiT of
`dlo_bench.models`, a small `AutoencoderKL` and the flow-matching scheduler, in diffusers layout
(`transformer/`, `vae/`, `scheduler/`, `model_index.json`).

Used by the demo, the server tests and `dlo bench serve`; weights come from a fixed seed, so every
process that writes the folder writes the same bytes. Must not be imported by the planes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from dlo_bench.models import save_diffusers_layout


def tiny_vae(seed: int = 0) -> nn.Module:
    """Two blocks (factor 2), one latent channel: Flux's in_channels of 4 are its 2x2 packing."""
    from diffusers import AutoencoderKL

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=1,
                            block_out_channels=(8, 8), layers_per_block=1, norm_num_groups=4,
                            down_block_types=("DownEncoderBlock2D",) * 2,
                            up_block_types=("UpDecoderBlock2D",) * 2,
                            scaling_factor=1.0, shift_factor=0.0)
    return vae.eval()


def save_pipeline_layout(dit: nn.Module, directory: Path, *, seed: int = 0) -> Path:
    """Write `dit`, a tiny VAE and the scheduler as a Flux model folder; returns `directory`."""
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler

    save_diffusers_layout(dit, directory)
    vae = tiny_vae(seed)
    vae.save_pretrained(directory / "vae", safe_serialization=True)
    FlowMatchEulerDiscreteScheduler(shift=3.0).save_pretrained(directory / "scheduler")
    (directory / "model_index.json").write_text(json.dumps({
        "_class_name": "FluxPipeline", "_diffusers_version": diffusers.__version__,
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "transformer": ["diffusers", type(dit).__name__],
        "vae": ["diffusers", type(vae).__name__]}, indent=2) + "\n")
    return directory
