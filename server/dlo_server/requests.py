"""The body of `POST /v1/images/generations` (OpenAI images API shape) checked and turned into
jobs (`Job`), one per image.

Owns the request fields, their defaults and bounds (`Limits`), and the 400 answer's wording: each
`RequestError` names the field as the client wrote it, the value, and what is accepted. Whatever
a decoded body holds, `parse_request` either returns jobs the pipeline can run or raises
`RequestError`: nothing a client sends reaches the ranks unchecked (a job that fails there fails
only its request, but costs the wave's compute). Pure: no HTTP, no torch.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass, replace
from typing import Any


RESPONSE_FORMAT = "b64_json"
FIELDS = ("prompt", "n", "size", "response_format", "num_inference_steps", "guidance_scale",
          "seed", "model", "user", "negative_prompt", "true_cfg_scale")
"""Every field a request may carry; `model`, when given, must name the served model; `user` is
accepted and not used."""
VIDEO_FIELDS = ("prompt", "size", "num_frames", "num_inference_steps", "guidance_scale", "seed",
                "negative_prompt", "model", "user")
"""Every field of `POST /v1/videos` (one video per request)."""

PROMPT_WHITESPACE = "\t\n\r"
"""The only control characters a prompt may hold. A prompt is text a tokenizer can take: valid
Unicode (no lone surrogate, which has no UTF-8 form) without control characters (Unicode category
Cc: NUL, escape sequences, C1 codes), which carry no meaning for a text encoder; format
characters (zero-width joiners of emoji, marks of direction) are text and pass."""
_SIZE = re.compile(r"([0-9]{1,5})x([0-9]{1,5})")
"""`WIDTHxHEIGHT` in ASCII digits: `str.isdigit` and `int` also take other scripts' digits and
superscripts ("٣٢", "²")."""


@dataclass(frozen=True)
class Job:
    """What a request asks for: one call of the pipeline, `n` images (or videos) drawn from one
    generator seeded with `seed`, as diffusers' `num_images_per_prompt=n` does (image i of n is
    not the image of seed + i)."""

    prompt: str
    width: int
    height: int
    steps: int
    guidance_scale: float
    seed: int
    n: int = 1
    negative_prompt: str | None = None
    true_cfg_scale: float = 1.0
    """Flux's true classifier-free guidance: on with a negative prompt and a scale above 1."""
    frames: int = 1
    """Video frames (video pipelines)."""


@dataclass(frozen=True)
class Limits:
    """What the server accepts: sizes are multiples of `size_multiple` up to `max_side`; `model`
    is the served model's name (`dlo serve --model`)."""

    size_multiple: int
    model: str = "dlo"
    max_side: int = 1024
    max_steps: int = 50
    max_n: int = 4
    max_prompt_chars: int = 4000
    """Characters (code points) of a prompt at most: OpenAI's bound for DALL-E 3. The text
    encoders truncate to their own token limits (77 for CLIP, 512 for T5) far below it."""
    max_guidance: float = 100.0
    """`guidance_scale` at most; pipelines use 1 to 20, and a larger finite value only makes
    noise."""
    default_size: str = "64x64"
    default_steps: int = 4
    default_guidance: float = 3.5
    videos: bool = False
    """The served pipeline makes videos (`/v1/videos`), not images."""
    frame_multiple: int = 1
    """A video's frames are 1 more than a multiple of this (the VAE's temporal factor)."""
    max_frames: int = 81
    default_frames: int = 5

    @property
    def max_body_bytes(self) -> int:
        """The largest body the server reads (a larger one gets 413): the longest prompt with
        every character written as a JSON escaped surrogate pair (12 bytes), and 4 KiB for the
        other fields."""
        return 12 * self.max_prompt_chars + 4096


class RequestError(ValueError):
    """A request the server refuses; `field` is the body's key at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class GenerationRequest:
    """A checked request: `jobs()` gives its one job (one pipeline call for its `n` images)."""

    prompt: str
    n: int
    width: int
    height: int
    steps: int
    guidance_scale: float
    seed: int
    negative_prompt: str | None = None
    true_cfg_scale: float = 1.0

    def jobs(self) -> list[Job]:
        return [Job(prompt=self.prompt, width=self.width, height=self.height, steps=self.steps,
                    guidance_scale=self.guidance_scale, seed=self.seed, n=self.n,
                    negative_prompt=self.negative_prompt, true_cfg_scale=self.true_cfg_scale)]


def parse_request(body: Any, limits: Limits, *, default_seed: int,
                  video: bool = False) -> GenerationRequest:
    """Check a decoded JSON body; raises `RequestError` naming the first field at fault.
    `default_seed` is used when the body names none; `video`: the fields of a video's body
    (`parse_video_request`)."""
    if not isinstance(body, dict):
        raise RequestError("body", "must be a JSON object")
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise RequestError(unknown[0], f"unknown field; accepted: {', '.join(FIELDS)}")
    prompt = _prompt(body.get("prompt"), limits)
    if limits.videos and not video:
        raise RequestError("model", f"{limits.model!r} makes videos: ask POST /v1/videos")
    if body.get("model", limits.model) != limits.model:
        raise RequestError("model", f"{body['model']!r} is not served here; this server serves "
                                    f"{limits.model!r}")
    if body.get("response_format", RESPONSE_FORMAT) != RESPONSE_FORMAT:
        raise RequestError("response_format", f"{body['response_format']!r} is not served; "
                                              f"use {RESPONSE_FORMAT!r}")
    width, height = _size(body.get("size", limits.default_size), limits)
    return GenerationRequest(
        prompt=prompt,
        n=_integer(body, "n", 1, 1, limits.max_n),
        width=width, height=height,
        steps=_integer(body, "num_inference_steps", limits.default_steps, 1, limits.max_steps),
        guidance_scale=_number(body, "guidance_scale", limits.default_guidance,
                               limits.max_guidance),
        seed=_integer(body, "seed", default_seed, 0, 2**63 - 1),
        negative_prompt=(None if body.get("negative_prompt") is None
                         else _prompt(body["negative_prompt"], limits, "negative_prompt")),
        true_cfg_scale=_number(body, "true_cfg_scale", 1.0, limits.max_guidance),
    )


def _integer(body: dict[str, Any], field: str, default: int, low: int, high: int) -> int:
    value = body.get(field, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(field, f"{value!r} is not an integer")
    if not low <= value <= high:
        raise RequestError(field, f"{value} is out of bounds; accepted: {low} to {high}")
    return value


def _number(body: dict[str, Any], field: str, default: float, high: float) -> float:
    """A finite number from 0 to `high` (JSON parsers take NaN and Infinity)."""
    value = body.get(field, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(field, f"{value!r} is not a number")
    if not 0 <= value <= high:  # False for NaN; compared before any float() of a huge int
        raise RequestError(field, f"{value!r} is out of bounds; accepted: a number from 0 to "
                                  f"{high:g}")
    return float(value)


def _prompt(value: Any, limits: Limits, field: str = "prompt") -> str:
    """Text a tokenizer can take, up to `max_prompt_chars` characters (`PROMPT_WHITESPACE`)."""
    if not isinstance(value, str) or not value:
        raise RequestError(field, "is required: a non-empty string")
    if len(value) > limits.max_prompt_chars:
        raise RequestError(field, f"has {len(value)} characters; accepted: at most "
                                     f"{limits.max_prompt_chars}")
    for index, char in enumerate(value):
        kind = unicodedata.category(char)
        if kind == "Cs" or (kind == "Cc" and char not in PROMPT_WHITESPACE):
            what = "a lone surrogate" if kind == "Cs" else "a control character"
            raise RequestError(field, f"character {index} ({ascii(char)}) is {what}; "
                                         "accepted: Unicode text, with tab, newline and "
                                         "carriage return as its only control characters")
    return value


def _size(value: Any, limits: Limits) -> tuple[int, int]:
    """`WIDTHxHEIGHT`, each side a multiple of the model's factor, at most `max_side`."""
    multiple = limits.size_multiple
    accepted = (f"WIDTHxHEIGHT, each a multiple of {multiple} from {multiple} to "
                f"{limits.max_side}")
    match = _SIZE.fullmatch(value) if isinstance(value, str) else None
    if match is None:
        shown = ascii(value[:40]) if isinstance(value, str) else repr(value)
        raise RequestError("size", f"{shown} is not {accepted}")
    width, height = int(match[1]), int(match[2])
    for side in (width, height):
        if side % multiple or not multiple <= side <= limits.max_side:
            raise RequestError("size", f"{value!r}: {side} is not a multiple of {multiple} "
                                       f"from {multiple} to {limits.max_side} (the model's "
                                       "patch times its VAE factor)")
    return width, height


def parse_video_request(body: Any, limits: Limits, *, default_seed: int) -> Job:
    """Check a decoded `POST /v1/videos` body (`VIDEO_FIELDS`): its one job."""
    if not isinstance(body, dict):
        raise RequestError("body", "must be a JSON object")
    unknown = sorted(set(body) - set(VIDEO_FIELDS))
    if unknown:
        raise RequestError(unknown[0], f"unknown field; accepted: {', '.join(VIDEO_FIELDS)}")
    if not limits.videos:
        raise RequestError("model", f"{limits.model!r} makes images: ask POST "
                                    "/v1/images/generations")
    frames = _integer(body, "num_frames", limits.default_frames, 1, limits.max_frames)
    if (frames - 1) % limits.frame_multiple:
        raise RequestError("num_frames", f"{frames} is not 1 more than a multiple of "
                                         f"{limits.frame_multiple} (the model's temporal factor)")
    rest = {field: value for field, value in body.items() if field != "num_frames"}
    [job] = parse_request(rest, limits, default_seed=default_seed, video=True).jobs()
    return replace(job, frames=frames)
