"""`python -m support.server_reference MODEL_DIR JOBS_JSON`: each job (the fields of
`dlo_server.requests.Job`) made by the model folder's own diffusers pipeline, called directly with
a resident transformer and `generator=torch.Generator("cpu").manual_seed(seed)`, in this one
process with one thread; rewrites JOBS_JSON with the outputs: per job a list of PNGs (base64),
or for a video pipeline a list of videos, each its frames as uint8 (nested lists)."""

from __future__ import annotations

import base64
import io
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from dlo_bench.serve_model import direct_pipeline

VIDEO_PIPELINES = ("WanPipeline",)


def direct_call(pipe: Any, job: dict[str, Any]) -> list[Any]:
    """The pipeline's outputs for `job`, as a user calls it."""
    video = type(pipe).__name__ in VIDEO_PIPELINES
    arguments = {"prompt": job["prompt"], "height": job["height"], "width": job["width"],
                 "num_inference_steps": job["steps"], "guidance_scale": job["guidance_scale"],
                 "generator": torch.Generator("cpu").manual_seed(job["seed"]),
                 "num_videos_per_prompt" if video else "num_images_per_prompt": job.get("n", 1),
                 "output_type": "np" if video else "pil"}
    if job.get("negative_prompt") is not None:
        arguments["negative_prompt"] = job["negative_prompt"]
    if "true_cfg_scale" in job:
        arguments["true_cfg_scale"] = job["true_cfg_scale"]
    if video:
        arguments["num_frames"] = job["frames"]
    with torch.inference_mode():
        out = pipe(**arguments)
    if video:
        return [(np.clip(frames, 0, 1) * 255).round().astype(np.uint8).tolist()
                for frames in out.frames]
    return [_png(image) for image in out.images]


def _png(image: Any) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def main(model: Path, jobs_file: Path) -> None:
    torch.set_num_threads(1)
    pipe = direct_pipeline(model)
    jobs = json.loads(jobs_file.read_text())
    jobs_file.write_text(json.dumps([direct_call(pipe, job) for job in jobs]))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
