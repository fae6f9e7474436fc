"""The pipeline `dlo serve` runs: a Flux sampler over a DiT, diffusers' flow-matching scheduler
and VAE, and a prompt encoder.

Owns turning one job (prompt, size, steps, guidance, seed) into PNG bytes, and the dropped work
an idle rank of an AllGather wave runs (`idle`: the same number of DiT forwards on the smallest
latent, output discarded). The DiT is whatever the caller built (`pod.build_dit` offloaded, or a
resident copy for a reference); the VAE and scheduler load from the entry's `vae/` and
`scheduler/` folders (diffusers layout). diffusers' own `FluxPipeline` needs the `transformers`
package for its text encoders, which the install does not carry, so the denoising loop is
diffusers' Flux loop written out here and the prompt goes through `HashedPromptEncoder`, a
stand-in that fits random-weight models: embeddings drawn from a seed hashed from the prompt.
Must not create process groups or know about waves, HTTP or ranks.
"""

from __future__ import annotations

import hashlib
import io
import logging
from pathlib import Path

import numpy as np
import torch
from torch import nn

from dlo_server.requests import Job

log = logging.getLogger(__name__)

TEXT_TOKENS = 8
"""Sequence length of the hashed prompt embeddings."""


class HashedPromptEncoder:
    """Prompt embeddings for a random-weight DiT: drawn from a generator seeded with the
    prompt's SHA-256, so a prompt always gives the same embeddings in every process."""

    def __init__(self, text_dim: int, pooled_dim: int) -> None:
        self.text_dim = text_dim
        self.pooled_dim = pooled_dim

    def __call__(self, prompt: str, dtype: torch.dtype, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        seed = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "little")
        gen = torch.Generator().manual_seed(seed)
        text = torch.randn(1, TEXT_TOKENS, self.text_dim, generator=gen)
        pooled = torch.randn(1, self.pooled_dim, generator=gen)
        return text.to(device, dtype), pooled.to(device, dtype)


class FluxSampler:
    """Flux text-to-image over `dit`, with the VAE and scheduler of the model folder `path`."""

    def __init__(self, dit: nn.Module, path: Path, device: torch.device) -> None:
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler

        self.dit = dit
        self.device = device
        self.vae = AutoencoderKL.from_pretrained(path / "vae", low_cpu_mem_usage=False)
        self.vae.eval().to(device)
        self.scheduler_config = FlowMatchEulerDiscreteScheduler.load_config(path / "scheduler")
        config = dit.config
        self.dtype = next(p for p in dit.parameters()).dtype
        self.latent_channels = config.in_channels // 4
        self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
        self.encode = HashedPromptEncoder(config.joint_attention_dim,
                                          config.pooled_projection_dim)

    @property
    def size_multiple(self) -> int:
        """Width and height must be multiples of this: the VAE's factor times the 2x2 packing
        of Flux latents times the DiT's own patch."""
        return self.vae_scale_factor * 2 * int(self.dit.config.patch_size)

    def generate(self, job: Job) -> bytes:
        """The PNG of one job."""
        with torch.inference_mode():
            latents = self._denoise(job)
            image = self._decode(latents, job.height, job.width)
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        return buffer.getvalue()

    def idle(self, steps: int) -> None:
        """What a rank without a request runs in a wave: `steps` DiT forwards (every block,
        every gather) on the smallest latent, the output dropped."""
        smallest = Job(prompt="", width=self.size_multiple, height=self.size_multiple,
                       steps=steps, guidance_scale=0.0, seed=0)
        with torch.inference_mode():
            self._denoise(smallest)

    def _denoise(self, job: Job) -> torch.Tensor:
        from diffusers import FlowMatchEulerDiscreteScheduler

        scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.scheduler_config)
        text, pooled = self.encode(job.prompt, self.dtype, self.device)
        rows = 2 * (job.height // (self.vae_scale_factor * 2))
        cols = 2 * (job.width // (self.vae_scale_factor * 2))
        gen = torch.Generator().manual_seed(job.seed)
        noise = torch.randn(1, self.latent_channels, rows, cols, generator=gen)
        latents = _pack(noise.to(self.device, self.dtype))
        img_ids = _image_ids(rows // 2, cols // 2).to(self.device, self.dtype)
        txt_ids = torch.zeros(text.shape[1], 3, device=self.device, dtype=self.dtype)
        sigmas = np.linspace(1.0, 1 / job.steps, job.steps)
        extra = {"mu": _shift(latents.shape[1], scheduler.config)} \
            if scheduler.config.use_dynamic_shifting else {}
        scheduler.set_timesteps(sigmas=sigmas, device=self.device, **extra)
        guidance = (torch.full([1], job.guidance_scale, device=self.device, dtype=self.dtype)
                    if self.dit.config.guidance_embeds else None)
        for t in scheduler.timesteps:
            noise_pred = self.dit(hidden_states=latents, timestep=t.expand(1).to(self.dtype) / 1000,
                                  guidance=guidance, pooled_projections=pooled,
                                  encoder_hidden_states=text, txt_ids=txt_ids, img_ids=img_ids,
                                  return_dict=False)[0]
            latents = scheduler.step(noise_pred, t, latents, return_dict=False)[0]
        return _unpack(latents, rows, cols, self.latent_channels)

    def _decode(self, latents: torch.Tensor, height: int, width: int):  # noqa: ANN202 (PIL)
        from PIL import Image

        config = self.vae.config
        latents = latents / config.scaling_factor + (config.shift_factor or 0.0)
        image = self.vae.decode(latents.to(self.vae.dtype), return_dict=False)[0]
        pixels = ((image[0].float().cpu() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
        return Image.fromarray(pixels.permute(1, 2, 0).numpy(), mode="RGB")


def _pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/2 * W/2, C * 4): Flux's 2x2 patches as tokens."""
    b, c, h, w = latents.shape
    latents = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return latents.reshape(b, (h // 2) * (w // 2), c * 4)


def _unpack(latents: torch.Tensor, rows: int, cols: int, channels: int) -> torch.Tensor:
    b = latents.shape[0]
    latents = latents.view(b, rows // 2, cols // 2, channels, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return latents.reshape(b, channels, rows, cols)


def _image_ids(rows: int, cols: int) -> torch.Tensor:
    ids = torch.zeros(rows, cols, 3)
    ids[..., 1] = torch.arange(rows)[:, None]
    ids[..., 2] = torch.arange(cols)[None, :]
    return ids.reshape(rows * cols, 3)


def _shift(image_tokens: int, config: dict) -> float:
    """Flux's resolution-dependent shift of the sigmas (diffusers' `calculate_shift`)."""
    base_len, max_len = config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096)
    base, top = config.get("base_shift", 0.5), config.get("max_shift", 1.15)
    slope = (top - base) / (max_len - base_len)
    return image_tokens * slope + base - slope * base_len


def resident_dit(path: Path, device: torch.device) -> nn.Module:
    """The DiT of the model folder `path` loaded whole, each tensor in a fresh (aligned)
    allocation as an offloaded DiT's slots are: the reference a served image is compared with
    (diffusers leaves loaded tensors as views at unaligned file offsets, and CPU kernels round
    differently for unaligned operands)."""
    from diffusers import FluxTransformer2DModel

    dit = FluxTransformer2DModel.from_pretrained(path / "transformer",
                                                 low_cpu_mem_usage=False).eval()
    for tensor in [*dit.parameters(), *dit.buffers()]:
        tensor.data = tensor.data.clone()
    return dit.to(device)
