"""The in-pod entry point: the one import an inference server needs.

    dit = pod.build_dit(FluxTransformer2DModel)          # weightless when the entry can back it
    pipe = FluxPipeline.from_pretrained(path, transformer=dit, ...)
    handle = pod.enable(pipe, device="cuda:0")           # or enable(dit)
    ...serve...
    handle.close()                                       # then destroy process groups

Owns the startup sequence of one process: read the settings document (`DLO_CONFIG`) and the
loader's entry document (`names.ENTRY_FILE_ENV`), pick each DiT's host backing (a checkpoint plan
over the mapped entry, a runtime-cache plan, or the ordinary tensors, logging why), register a
runtime-cache mapping when a budget allows, take the server's existing process group (or the
default world) by `validation.select_group`, and enable `DistributedLayerwiseOffloadBackend` on
each DiT. `build_dit` starts warming the page cache with the entry (`prefetch`; a no-op when the
server started it before its own imports). `OffloadHandle.close()` follows the shutdown order:
synchronize, remove hooks, unregister, close mappings; the caller destroys its process groups
afterwards. With `offload.enabled=false` the same calls keep the DiTs resident: `build_dit` loads
ordinarily and `enable` moves the DiTs to the device and returns a handle that offloads nothing.

Must not create process groups, load pipeline components other than the DiT, or decide
compatibility itself (the plan builders and `validation` do).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dlo_runtime import checkpoint_plan
from dlo_contract.cache import open_entry
from dlo_runtime import prefetch
from dlo_runtime.discovery import find_dits
from dlo_runtime.errors import OffloadError
from dlo_runtime.metrics import NoStatistics
from dlo_runtime.entry_file import (  # noqa: F401 (re-exported: the pod API)
    DEFAULT_ENTRY_FILE,
    ENTRY_FILE_ENV,
    EntryRef,
    PodError,
    entry_file_path,
    read_entry_file,
    wait_for_entry_file,
)
from dlo_runtime.host_registration import register_plan
from dlo_runtime.host_weight_plan import BackingKind, HostWeightPlan
from dlo_runtime.misuse import refuse_misuse, refuse_unbacked
from dlo_runtime.placement import resolve_placement
from dlo_runtime.run_stats import RESIDENT, OffloadStats
from dlo_runtime.runtime_weight_cache import RuntimeLayout, load_runtime_plan
from dlo_contract.field_names import Names
from dlo_contract.settings import GIB, Settings, load_settings
from dlo_contract.validation import names_for, validate

logger = logging.getLogger(__name__)


def build_dit(model_cls: Any, *, component: str = "transformer", dtype: torch.dtype = torch.float32,
              settings: Settings | None = None, entry_file: str | None = None) -> nn.Module:
    """The DiT of `component`: weightless (parameters on meta) when checkpoint preflight over
    the pod's entry accepts it, so `enable()` backs it with the mapping; otherwise loaded
    ordinarily from the entry with `from_pretrained`."""
    settings = _validated(settings)
    names = names_for(settings)
    entry = wait_for_entry_file(entry_file, names=names)
    if entry is None:
        raise PodError(f"no entry file at {entry_file_path(entry_file)}",
                       hint="run the loader (`dlo cache fill`) first, or load the DiT yourself")
    prefetch.start(entry_file)
    folder = entry.path / component
    dit = checkpoint_plan.build_meta_dit(model_cls, folder, dtype)
    if settings.offload.enabled:
        result = checkpoint_plan.preflight(entry.path, dit, settings, component=component,
                                           names=names)
        if result.plan is not None:
            result.plan.close()
            return dit
        logger.info("loading %s ordinarily: %s", component, result.reason)
    return model_cls.from_pretrained(folder, torch_dtype=dtype, low_cpu_mem_usage=False).eval()


@dataclass
class _Offloaded:
    component: str
    backend: Any
    plan: HostWeightPlan | None


class OffloadHandle:
    """What `enable()` returns: the enabled backends and the host plans they consume, or the
    DiTs kept resident (`offload.enabled=false`), which have neither."""

    def __init__(self, device: torch.device, offloaded: list[_Offloaded],
                 resident: tuple[str, ...] = ()) -> None:
        self.device = device
        self._offloaded = offloaded
        self._resident = resident
        self._closed = False

    def backing(self, component: str = "transformer") -> BackingKind:
        """Host backing of one DiT (`ordinary` when it kept its loader tensors)."""
        for item in self._offloaded:
            if item.component == component:
                return item.plan.backing_kind if item.plan else BackingKind.ORDINARY
        if component in self._resident:
            return BackingKind.ORDINARY
        raise KeyError(component)

    @property
    def slot_bytes(self) -> int:
        """Bytes of the backends' device slots (host memory when the device is the CPU)."""
        return sum(item.backend.slot_bytes for item in self._offloaded)

    @property
    def streamed_share(self) -> float:
        """Share of the DiTs' weight bytes streamed through the device slots (the rest stays
        resident or comes in on demand), as logged at enable."""
        total = sum(item.backend.streamed_bytes / item.backend.streamed_share
                    for item in self._offloaded if item.backend.streamed_share)
        streamed = sum(item.backend.streamed_bytes for item in self._offloaded)
        return streamed / total if total else 0.0

    def stats(self, component: str = "transformer") -> OffloadStats:
        """Run-time statistics of one DiT's backend (see `dlo_runtime.run_stats`); after
        `close()`, `NoStatistics` (a collector registered with the server then reports nothing
        instead of failing its scrapes)."""
        if self._closed:
            raise NoStatistics(f"the offload handle is closed: {component} has no statistics "
                               "any more")
        for item in self._offloaded:
            if item.component == component:
                return item.backend.stats()
        if component in self._resident:
            return RESIDENT
        raise KeyError(component)

    def close(self) -> None:
        """Shutdown order: synchronize device work, remove hooks, unregister host pages, close
        mappings. Process groups stay; the caller destroys them afterwards. Every backend is
        closed even when one raises `OffloadError` (its DLO group drifted: it tore down alone,
        see `dlo_runtime.lockstep`); the first such error is raised at the end."""
        self._closed = True
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no copy may still read pages about to go
        first: OffloadError | None = None
        while self._offloaded:
            item = self._offloaded.pop()
            try:
                item.backend.disable(restore=False)
            except OffloadError as exc:  # raised once its teardown is complete
                first = first or exc
            if item.plan is not None:
                item.plan.close()
        if first is not None:
            raise first


def enable(target: Any, *, device: str | torch.device | None = None,
           settings: Settings | None = None, entry_file: str | None = None,
           groups: Mapping[str, Any] | None = None,
           layout: RuntimeLayout | None = None) -> OffloadHandle:
    """Offload the DiT(s) of `target` (a pipeline or a DiT module) as the settings say.

    `groups` maps "dp"/"sp" to the server's existing process groups; absent ones fall back to
    the default world. `layout` describes this rank for the runtime cache (TP coordinates, SP
    guards). A DiT built without weights whose plan cannot be consumed is a startup error.
    With `offload.enabled=false` the DiTs stay resident (`_keep_resident`).
    """
    from dlo_runtime.backend import DistributedLayerwiseOffloadBackend

    settings = _validated(settings)
    names = names_for(settings)  # the runtime's one namer, handed to all that writes messages
    torch_device = _device(device)
    if not settings.offload.enabled:
        return _keep_resident(target, settings, torch_device, names)
    placement = resolve_placement(settings, names=names, groups=groups)
    entry = wait_for_entry_file(entry_file, names=names)
    layout = layout or RuntimeLayout(tp_size=settings.parallel.tp, sp_size=settings.parallel.sp,
                                     source=entry.entry_id if entry else "")
    handle = OffloadHandle(torch_device, [])
    dits = find_dits(target)
    for _, dit in dits:
        # Before any plan maps or registers anything; meta tensors are the plans' business.
        refuse_misuse(dit, host_plan=True)
    try:
        for component, dit in dits:
            plan = _host_plan(component, dit, settings, entry, layout, torch_device, names)
            try:
                backend = DistributedLayerwiseOffloadBackend(
                    dit, settings=settings, device=torch_device, host_plan=plan,
                    placement=placement, names=names)
            except BaseException:
                if plan is not None:  # not the handle's yet: its close() would not see it
                    plan.close()
                raise
            handle._offloaded.append(_Offloaded(component, backend, plan))
            backend.enable()
            logger.info("%s: host backing %s%s", component,
                        plan.backing_kind.value if plan else "ordinary",
                        " (registered pages)" if plan and plan.sources_pinned else "")
            if plan is not None:
                plan.require_consumed()
    except BaseException:
        try:
            handle.close()
        except OffloadError as drift:  # the startup error below is the one to report
            logger.warning("dlo: closing the backends enabled before the failure: %s", drift)
        raise
    return handle


def _keep_resident(target: Any, settings: Settings, device: torch.device,
                   names: Names) -> OffloadHandle:
    """Offload disabled: the DiTs move to `device` whole (unless the settings leave their
    placement to the server's own CPU offload), no backend is built, and the handle's `close()`
    has nothing to undo."""
    dits = find_dits(target)
    for _, dit in dits:
        refuse_unbacked(dit)
    offload = settings.offload
    server_offloads = offload.model_cpu_offload or offload.layerwise_cpu_offload
    if not server_offloads:
        for _, dit in dits:
            dit.to(device)
    components = tuple(component for component, _ in dits)
    logger.info("dlo: %s=false: %s %s, nothing streams", names("offload.enabled"),
                ", ".join(components), "left to the server's CPU offload" if server_offloads
                else f"resident on {device}")
    return OffloadHandle(device, [], resident=components)


def _validated(settings: Settings | None) -> Settings:
    """The settings passed, else the pod's document, validated: once per public call, and
    handed down from there (backends get them with their placement and do not re-check)."""
    return validate(settings if settings is not None else load_settings())


def _device(device: str | torch.device | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _host_plan(component: str, dit: nn.Module, settings: Settings, entry: EntryRef | None,
               layout: RuntimeLayout, device: torch.device, names: Names) -> HostWeightPlan | None:
    """Checkpoint plan for a weightless DiT, runtime-cache plan when enabled, else None."""
    weightless = any(p.is_meta for p in dit.parameters())
    if weightless:
        return _checkpoint_plan(component, dit, settings, entry, names)
    result = load_runtime_plan(dit, settings, layout, names=names)
    if result.plan is None:
        logger.info("%s keeps its ordinary tensors: %s", component, result.reason)
        return None
    limit = settings.offload.runtime_cache_pin_limit_gib
    if limit > 0 and device.type == "cuda":
        from dlo_runtime.cuda_registration import CudaRegistrationBackend

        register_plan(result.plan, budget_bytes=int(limit * GIB),
                      backend=CudaRegistrationBackend(device.index or 0),
                      names=names)
    return result.plan


def _checkpoint_plan(component: str, dit: nn.Module, settings: Settings,
                     entry: EntryRef | None, names: Names) -> HostWeightPlan:
    if entry is None:
        raise PodError(f"{component} has no weights (meta parameters) and no entry file names a "
                       "checkpoint to map", hint="build it with pod.build_dit() in a pod that ran "
                                                 "the loader")
    handle = open_entry(entry.root, entry.entry_id, verify=settings.cache.verify)
    result = checkpoint_plan.preflight(handle.path, dit, settings, component=component,
                                       handle=handle, skips_ordinary_load=True, names=names)
    if result.plan is None:
        handle.close()
        raise PodError(f"{component} was built without weights but its checkpoint plan was "
                       f"rejected: {result.reason}", hint="load the DiT ordinarily")
    return result.plan
