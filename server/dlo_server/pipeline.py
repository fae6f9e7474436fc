"""The pipeline `dlo serve` runs: the one the entry's `model_index.json` names, built with
diffusers' own classes and loading, around a DiT the caller built (`pod.build_dit`).

Owns the families the server serves (`FAMILIES`: the pipeline class, what it outputs, the request
fields it takes), the checks made at start (a pipeline or component class the server cannot serve,
a component the entry lacks: each refused naming the class or folder and the fix), and where the
text encoders live between requests (`TextEncoders`). Called by `dlo_server.engine` at start.
Must not create process groups, enable offloading or know about HTTP, waves or ranks.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dlo_contract.names import PIPELINE_INDEX
from dlo_runtime.errors import PodError

if TYPE_CHECKING:  # torch is imported where a pipeline is loaded: `dlo serve --help` needs none
    import torch
    from torch import nn

log = logging.getLogger(__name__)

DIT = "transformer"
"""The component `pod.build_dit` builds and `pod.enable` offloads."""
LIBRARIES = ("diffusers", "transformers")
"""Where a component's class may come from."""


class Output(str, Enum):
    """What a family makes: images (`/v1/images/generations`) or videos (`/v1/videos`)."""

    IMAGE = "image"
    VIDEO = "video"


class TextEncoders(str, Enum):
    """Where the text encoders live (`dlo serve --text-encoders`)."""

    DEVICE = "device"
    """On the device for the server's life: their whole size in device memory."""
    OFFLOADED = "offloaded"
    """In host memory; each moves to the device for its own forward and back right after it, so
    the device holds at most one encoder, and never beside the DiT's forwards."""


@dataclass(frozen=True)
class Family:
    """A pipeline class the server serves, and how it is called."""

    pipeline: str
    output: Output
    true_cfg: bool = False
    """Takes `true_cfg_scale` (classifier-free guidance with a negative prompt, as Flux has)."""


FAMILIES = {family.pipeline: family for family in (
    Family("FluxPipeline", Output.IMAGE, true_cfg=True),
    Family("StableDiffusion3Pipeline", Output.IMAGE),
    Family("ZImagePipeline", Output.IMAGE),
    Family("WanPipeline", Output.VIDEO),
)}
"""The pipelines the server serves, each tested bit for bit against diffusers (tests/server)."""


def index_of(path: Path) -> dict[str, Any]:
    """The entry's `model_index.json`; a missing one is refused naming the include that adds
    it."""
    index = path / PIPELINE_INDEX
    if not index.is_file():
        raise PodError(f"the entry has no {PIPELINE_INDEX}: dlo serve builds the pipeline it names",
                       hint=f'cache the whole pipeline (model.include: ["{PIPELINE_INDEX}", ...] '
                            "or the default, which follows it)")
    return json.loads(index.read_text())


def family_of(index: dict[str, Any]) -> Family:
    """The served family of `index`; any other pipeline class is refused, naming those served."""
    name = index.get("_class_name")
    if name not in FAMILIES:
        raise PodError(f"{PIPELINE_INDEX} names the pipeline {name}, which dlo serve does not "
                       f"serve; it serves {', '.join(FAMILIES)}",
                       hint="serve it with your own server on the pod API (pod.build_dit, "
                            "pod.enable)")
    return FAMILIES[name]


def components_of(index: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """The components `index` lists (name: (library, class)), optional ones left out."""
    return {name: (value[0], value[1]) for name, value in index.items()
            if not name.startswith("_") and isinstance(value, list) and len(value) == 2
            and value[0] is not None and value[1] is not None}


def check_components(path: Path, index: dict[str, Any]) -> type[nn.Module]:
    """Each listed component's class must be one the server can load and its folder must be in
    the entry; returns the DiT's class."""
    import importlib

    components = components_of(index)
    missing = sorted(name for name in components if not (path / name).is_dir())
    if missing:
        raise PodError(f"the entry lacks {', '.join(f'{name}/' for name in missing)}, which "
                       f"{PIPELINE_INDEX} lists", hint="cache the whole pipeline: model.include "
                       "defaults to every folder model_index.json lists (or add "
                       + ", ".join(f'"{name}/*"' for name in missing) + ")")
    for name, (library, cls) in components.items():
        found = (getattr(importlib.import_module(library), cls, None)
                 if library in LIBRARIES else None)
        if found is None:
            raise PodError(f"{PIPELINE_INDEX}: component {name} is {library}.{cls}, which dlo "
                           f"serve cannot load; components come from {' or '.join(LIBRARIES)}")
        if name == DIT:
            dit_cls = found
    if DIT not in components:
        raise PodError(f"{PIPELINE_INDEX} lists no {DIT}: dlo serve offloads the pipeline's DiT")
    return dit_cls


def load_pipeline(path: Path, index: dict[str, Any], dit: nn.Module) -> Any:
    """The pipeline of `index` from the entry `path`, with diffusers' own loading, around `dit`
    (already built; its weights are the offload's business)."""
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()  # a server's log is not a terminal
    transformers.utils.logging.disable_progress_bar()
    cls = getattr(diffusers, index["_class_name"])
    pipeline = cls.from_pretrained(path, transformer=dit, low_cpu_mem_usage=False)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def place(pipeline: Any, device: torch.device, text_encoders: TextEncoders) -> None:
    """Every component but the DiT on `device`, the text encoders as `text_encoders` says."""
    for name, module in _modules(pipeline):
        if name == DIT:
            continue
        if name.startswith("text_encoder") and text_encoders is TextEncoders.OFFLOADED:
            _offload_between_calls(module, device)
        else:
            module.to(device)


def _modules(pipeline: Any) -> list[tuple[str, nn.Module]]:
    from torch import nn

    return [(name, module) for name, module in pipeline.components.items()
            if isinstance(module, nn.Module)]


def _offload_between_calls(encoder: nn.Module, device: torch.device) -> None:
    """`encoder` stays in host memory and moves to `device` for each forward, back after it."""
    import torch

    host = torch.device("cpu")
    encoder.to(host)
    if device.type == "cpu":
        return

    def onto_device(module: nn.Module, _args: Any) -> None:
        module.to(device)

    def back_to_host(module: nn.Module, _args: Any, _output: Any) -> None:
        # The outputs stay on the device; the stream orders the copy after the forward's kernels.
        module.to(host)

    encoder.register_forward_pre_hook(onto_device)
    encoder.register_forward_hook(back_to_host)
