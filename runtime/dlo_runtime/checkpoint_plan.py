"""Checkpoint preflight: prove that a cache entry's files can back the DiT as they are.

Owns the decision, made before the ordinary DiT load, to skip that load and map the checkpoint
instead. A checkpoint in diffusers layout (`<component>/diffusion_pytorch_model.safetensors`,
the same sharded with its `.index.json`, or one single-file checkpoint at the entry root) is
accepted only when every DiT parameter and persistent buffer has exactly one stored tensor with
the same name, shape and dtype, the topology is TP1 without HSDP, and no online quantization
rewrites the tensors. Anything else yields a plan-less `Preflight` whose `reason` says what
failed; the caller then loads ordinarily. A source file that also holds non-DiT tensors is
rejected as a whole: it cannot be skipped as a unit.

Called by the in-pod entry point (`dlo_runtime.pod`) and the benchmarks. Must not load weights
(the DiT is built with parameters on the meta device) nor schedule transfers.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dlo_contract.cache import safe_relpath
from dlo_runtime.host_weight_plan import (
    BackingKind, DeclaredTransform, HostWeightPlan, TensorBinding, runtime_tensors,
)
from dlo_runtime.mapping import MappedEntry, StoredTensor, read_header
from dlo_contract.settings import Settings
from dlo_contract.field_names import Names
from dlo_contract.validation import names_for

logger = logging.getLogger(__name__)

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
INDEX_NAME = WEIGHTS_NAME + ".index.json"


@dataclass(frozen=True)
class Preflight:
    """The outcome: a plan, or None and the reason the ordinary loader must run."""

    plan: HostWeightPlan | None
    reason: str | None = None


def settings_reason(settings: Settings, names: Names) -> str | None:
    """Topology, quantization and runtime-cache reasons that rule out a checkpoint plan of the
    validated `settings`, naming the settings through `names` (as the user wrote them)."""
    if settings.parallel.tp > 1:
        return (f"tensor parallelism is on ({names('parallel.tp')}={settings.parallel.tp}); each "
                "rank holds a slice, not the stored tensors")
    if settings.parallel.hsdp:
        return f"HSDP is on ({names('parallel.hsdp')}=true); it owns parameter sharding"
    if settings.quantization != "none":
        return (f"online quantization is on ({names('quantization')}={settings.quantization!r}); "
                "the runtime tensors differ from the stored ones")
    offload = settings.offload
    # Validated: a pin limit needs the runtime cache, which needs rank-local blocks.
    if offload.runtime_cache_pin_limit_gib > 0:
        return (f"{names('offload.runtime_cache_pin_limit_gib')}="
                f"{offload.runtime_cache_pin_limit_gib:g} selects the runtime cache, whose final "
                "tensors can be registered")
    return None


def preflight(
    entry_dir: Path,
    dit: nn.Module,
    settings: Settings,
    *,
    component: str = "transformer",
    transforms: Sequence[DeclaredTransform] = (),
    handle: Any = None,
    skips_ordinary_load: bool = False,
    names: Names | None = None,
) -> Preflight:
    """Check `dit` (meta or materialized) against the entry; map it when every check passes.

    `transforms` are loader-owned adapters (a stored tensor viewed in the runtime shape).
    `handle` is the entry's open `EntryHandle`; the accepted plan's mapping owns it, a rejected
    preflight leaves it with the caller. `names` spells the settings in the reason (default: as
    the settings' origin says, `validation.names_for`).
    """
    reason = settings_reason(settings, names or names_for(settings))
    if reason is None:
        try:
            sources = locate_sources(entry_dir, component)
        except ValueError as exc:
            reason = str(exc)
    if reason is None:
        stored, reason = _collect(entry_dir, sources)
    expected = runtime_tensors(dit)
    if reason is None:
        reason = _match(expected, stored, {t.name: t.shape for t in transforms})
    if reason is not None:
        logger.info("checkpoint plan rejected for %s: %s", entry_dir, reason)
        return Preflight(None, reason)
    bindings = [
        TensorBinding(name=name, file=stored[name][0], offset=stored[name][1].offset,
                      dtype=stored[name][1].dtype, shape=stored[name][1].shape)
        for name in expected
    ]
    covered = sorted({_prefix(file) for file in sources})
    plan = HostWeightPlan(
        backing_kind=BackingKind.CHECKPOINT, bindings=bindings, covered_prefixes=covered,
        transforms=transforms, source=MappedEntry(entry_dir, handle=handle),
        skips_ordinary_load=skips_ordinary_load,
    )
    return Preflight(plan)


def locate_sources(entry_dir: Path, component: str) -> list[str]:
    """The safetensors files holding `component`, relative to the entry, in diffusers order:
    sharded with an index, one component file, else a single file at the entry root."""
    folder = entry_dir / component
    index = folder / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            return sorted(safe_relpath(f"{component}/{name}") for name in set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"the shard index {component}/{INDEX_NAME} is unreadable: "
                             f"{exc}") from exc
    if (folder / WEIGHTS_NAME).is_file():
        return [f"{component}/{WEIGHTS_NAME}"]
    singles = sorted(p.name for p in entry_dir.glob("*.safetensors"))
    if len(singles) == 1:
        return singles
    raise ValueError(f"no safetensors weights for component {component!r}: expected "
                     f"{component}/{INDEX_NAME}, {component}/{WEIGHTS_NAME} or one "
                     f"*.safetensors file at the entry root, found {len(singles)} there")


def _collect(
    entry_dir: Path, sources: list[str]
) -> tuple[dict[str, tuple[str, StoredTensor]], str | None]:
    stored: dict[str, tuple[str, StoredTensor]] = {}
    for file in sources:
        for key, tensor in read_header(entry_dir / file).items():
            if key in stored:
                return stored, (f"tensor {key!r} has more than one source: "
                                f"{stored[key][0]} and {file}")
            stored[key] = (file, tensor)
    return stored, None


def _match(
    expected: dict[str, torch.Tensor],
    stored: dict[str, tuple[str, StoredTensor]],
    reshaped: dict[str, tuple[int, ...]],
) -> str | None:
    """The first mismatch between runtime tensors and stored ones, as a reason."""
    for key, (file, _) in sorted(stored.items()):
        if key not in expected:
            return (f"mixed source: {file} also holds {key!r}, which is not a DiT tensor; "
                    "the file cannot be skipped as a unit")
    for name, tensor in expected.items():
        if name not in stored:
            return f"missing tensor: {name!r} has no source in the checkpoint"
        file, found = stored[name]
        shape = reshaped.get(name, found.shape)
        if tuple(tensor.shape) != shape:
            return (f"shape mismatch for {name!r}: checkpoint {list(found.shape)} in {file}, "
                    f"runtime {list(tensor.shape)}")
        if tensor.dtype != found.dtype:
            return (f"dtype mismatch for {name!r}: checkpoint {found.dtype} in {file}, "
                    f"runtime {tensor.dtype}")
    return None


def _prefix(file: str) -> str:
    head, sep, _ = file.partition("/")
    return head + sep if sep else file


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """While active, every parameter a module registers moves to the meta device, so building a
    DiT allocates no weights, and `torch.nn.init`'s functions do nothing (a meta tensor holds no
    values to initialize; diffusers' own loader skips them the same way). Buffers stay real:
    non-persistent ones (rotary tables) are computed in `__init__` and no checkpoint holds
    them."""
    original = nn.Module.register_parameter
    inits = initializers()

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None:
            meta = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            module._parameters[name] = meta

    def skip(tensor: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
        return tensor

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    for name in inits:
        setattr(nn.init, name, skip)
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]
        for name, function in inits.items():
            setattr(nn.init, name, function)


def initializers() -> dict[str, Callable[..., Any]]:
    """`torch.nn.init`'s functions a module's `reset_parameters` may call, by name: the public
    ones that fill a tensor in place (`*_`), and their deprecated aliases without the
    underscore. Read from the module, so an initializer a torch release adds is skipped too."""
    public = {name: value for name, value in vars(nn.init).items()
              if not name.startswith("_") and callable(value)}
    return {name: value for name, value in public.items()
            if name.endswith("_") or f"{name}_" in public}


def build_meta_dit(model_cls: Any, component_dir: Path, dtype: torch.dtype) -> nn.Module:
    """Build the DiT from its `config.json` with parameters on the meta device, cast to `dtype`
    except the modules the class keeps in float32 (as diffusers' loader does)."""
    config = model_cls.load_config(component_dir)
    with parameters_on_meta():
        dit = model_cls.from_config(config)
    keep = getattr(dit, "_keep_in_fp32_modules", None) or ()
    for name, param in dit.named_parameters():
        kept = any(part in keep for part in name.split("."))
        param.data = param.data.to(torch.float32 if kept else dtype)
    return dit.eval()
