"""One job through the served pipeline: the diffusers pipeline of the entry, called as a user
would call it, its output turned into what the API returns.

Owns the call's arguments (`call_arguments`: a job's fields in the pipeline's own keywords, the
generator seeded with the job's seed on the CPU), the output (PNGs of an image family, uint8
frames of a video family), and the forwards an idle rank of an AllGather wave runs (`idle`: the
wave's first job again, stopped at the latents and dropped, so it makes the same DiT calls as
every job of the wave). Must not create process groups or know about waves, HTTP or ranks.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from dlo_server.pipeline import Family, Output
from dlo_server.requests import Job

IDLE_PROMPT = "idle"
"""The prompt of an idle rank's dropped forwards."""
Result = list[bytes] | list[np.ndarray]
"""A job's output: one PNG per image, or one (frames, height, width, 3) uint8 array per video."""


@dataclass
class Sampler:
    """The pipeline of `family` (its DiT offloaded, or resident for a reference)."""

    pipeline: Any
    family: Family

    @property
    def size_multiple(self) -> int:
        """Width and height must be multiples of this: the VAE's spatial factor times the DiT's
        patch (times Flux's 2x2 packing of latents)."""
        pipe, config = self.pipeline, self.pipeline.transformer.config
        factor = getattr(pipe, "vae_scale_factor_spatial", None) or pipe.vae_scale_factor
        patch = config.get("patch_size") or config.get("all_patch_size")
        patch = patch[-1] if isinstance(patch, (tuple, list)) else patch
        packing = 2 if self.family.pipeline == "FluxPipeline" else 1
        return int(factor) * int(patch) * packing

    @property
    def frame_multiple(self) -> int:
        """A video's frames are 1 more than a multiple of this (the VAE's temporal factor)."""
        return int(getattr(self.pipeline, "vae_scale_factor_temporal", 1))

    def generate(self, job: Job) -> Result:
        """The images (PNG) or videos (frames) of `job`."""
        output_type = "pil" if self.family.output is Output.IMAGE else "np"
        with torch.inference_mode():
            out = self.pipeline(**call_arguments(job, self.family, output_type))
        if self.family.output is Output.IMAGE:
            return [_png(image) for image in out.images]
        return [to_uint8(video) for video in out.frames]

    def idle(self, job: Job, forwards: int | None = None) -> None:
        """What a rank without a job of its own runs in a wave whose first job is `job`: the
        same DiT calls (its wave key, with `IDLE_PROMPT` for its texts, which may be what made
        a job fail), stopped at the latents, the output dropped; with `forwards`, only the first
        that many DiT calls."""
        job = replace(job, prompt=IDLE_PROMPT, negative_prompt=None if job.negative_prompt is None
                      else IDLE_PROMPT)
        hook = None
        if forwards is not None:
            made = iter(range(1, forwards + 1))

            def count(*_: Any) -> None:
                if next(made, forwards) == forwards:
                    raise _Enough  # after the forward's own end hooks, which ran first

            hook = self.pipeline.transformer.register_forward_hook(count)
        try:
            with torch.inference_mode():
                self.pipeline(**call_arguments(job, self.family, "latent"))
        except _Enough:
            pass
        finally:
            if hook is not None:
                hook.remove()


class _Enough(Exception):
    """An idle run made the DiT calls it was asked for."""


def call_arguments(job: Job, family: Family, output_type: str) -> dict[str, Any]:
    """The pipeline's keywords for `job` (what a direct call with the same fields passes)."""
    per_prompt = "num_videos_per_prompt" if family.output is Output.VIDEO else \
        "num_images_per_prompt"
    arguments: dict[str, Any] = {
        "prompt": job.prompt, "height": job.height, "width": job.width,
        "num_inference_steps": job.steps, "guidance_scale": job.guidance_scale,
        per_prompt: job.n, "generator": torch.Generator("cpu").manual_seed(job.seed),
        "output_type": output_type}
    if job.negative_prompt is not None:
        arguments["negative_prompt"] = job.negative_prompt
    if family.true_cfg:
        arguments["true_cfg_scale"] = job.true_cfg_scale
    if family.output is Output.VIDEO:
        arguments["num_frames"] = job.frames
    return arguments


def to_uint8(frames: np.ndarray) -> np.ndarray:
    """Frames in [0, 1] as uint8 (what the MP4 encodes)."""
    return (np.clip(frames, 0.0, 1.0) * 255).round().astype(np.uint8)


def _png(image: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()
