"""The runtime weight cache: share the ordinary loader's final DiT tensors through the node cache.

Owns the opt-in, no-AllGather path of the design ("Phase B"): after the ordinary load, check the
DiT's tensors can be stored as they are (contiguous CPU tensors, no aliasing or tying, no
quantized or distributed tensors), hash names, metadata and bytes, then publish or join the
runtime entry of that content and layout through `dlo_contract.cache`, map it back, check that the
mapped tensors hash to the same digest, and return a `HostWeightPlan(runtime_cache)`.

The identity holds the TP size and rank and the SP guards (implementation and size), never the
DP or SP rank: replicas with the same final bytes share one entry, different TP slices do not.
Any incompatibility, cache error or lock timeout returns no plan with the reason; the caller keeps
its ordinary tensors, which this module never modifies. Called by `dlo_runtime.pod`.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from dlo_contract.cache import (
    FileRecord, begin_publication, entry_id, open_entry, remove_command, runtime_identity,
)
from dlo_contract.errors import DloError
from dlo_runtime.host_weight_plan import BackingKind, HostWeightPlan, TensorBinding, runtime_tensors
from dlo_runtime.mapping import MappedEntry, read_header, write_safetensors
from dlo_contract.settings import GIB, Settings
from dlo_contract.field_names import Names, document_names
from dlo_runtime.errors import RuntimeCacheMismatch

logger = logging.getLogger(__name__)

SHARD_BYTES = 2 * GIB
"""Upper bound on one runtime entry file; keeps single files below common tooling limits."""
_HEADER_SLACK = 1 << 20
"""Free space asked for beyond the tensor bytes, for safetensors headers and the manifest."""


@dataclass(frozen=True, kw_only=True)
class RuntimeLayout:
    """What, besides the bytes, makes two processes' runtime tensors interchangeable."""

    tp_size: int = 1
    """Tensor-parallel world size: each TP rank holds a different slice."""
    tp_rank: int = 0
    """This process's TP rank."""
    sp_size: int = 1
    """Sequence-parallel world size: a guard, since SP implementations may shape weights."""
    sp_impl: str = "none"
    """Sequence-parallel implementation name, a guard for the same reason."""
    source: str = ""
    """Where the ordinary loader read the checkpoint (entry id or URI)."""

    def identity(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, object]:
        return {
            "tp_world_size": self.tp_size, "tp_rank": self.tp_rank,
            "sp_guard": {"impl": self.sp_impl, "world_size": self.sp_size},
            "dtypes": sorted({str(t.dtype) for t in tensors.values()}),
            "source": self.source,
        }


@dataclass(frozen=True)
class RuntimeCacheResult:
    """A validated plan over the entry, or None and the reason the ordinary tensors stay."""

    plan: HostWeightPlan | None
    reason: str | None = None
    entry_id: str | None = None
    published: bool = False


def layout_problem(tensors: Mapping[str, torch.Tensor], dit: torch.nn.Module) -> str | None:
    """Why these tensors cannot be stored and mapped back one to one, or None."""
    first_name: dict[int, str] = {}
    for name, param in dit.named_parameters(remove_duplicate=False):
        if id(param) in first_name:
            return f"tied parameters: {first_name[id(param)]!r} and {name!r} are one tensor"
        first_name[id(param)] = name
    spans: list[tuple[int, int, str]] = []
    for name, tensor in tensors.items():
        problem = _tensor_problem(tensor)
        if problem:
            return f"{name!r} {problem}"
        if tensor.nbytes:
            spans.append((tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes, name))
    spans.sort()
    for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
        if start < end:
            return f"aliased tensors: {first!r} and {second!r} share storage"
    return None


def _tensor_problem(tensor: torch.Tensor) -> str | None:
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        return "is a distributed tensor (DTensor)"
    if tensor.is_quantized or tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return f"is quantized ({tensor.dtype})"
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        return f"is a tensor subclass ({type(tensor).__name__})"
    if tensor.device.type != "cpu":
        return f"is on {tensor.device}, not on the CPU"
    if not tensor.is_contiguous():
        return "is not contiguous"
    return None


def content_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over every tensor's name, dtype, shape and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name]
        digest.update(f"{name}\0{tensor.dtype}\0{list(tensor.shape)}\0".encode())
        if tensor.nbytes:
            digest.update(tensor.detach().reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


def load_runtime_plan(
    dit: torch.nn.Module, settings: Settings, layout: RuntimeLayout, *,
    shard_bytes: int = SHARD_BYTES, names: Names = document_names,
) -> RuntimeCacheResult:
    """Publish or join the runtime entry of `dit`'s final tensors and return a plan over it.
    `settings` are validated: a runtime cache that is on serves rank-local blocks (the
    `runtime-cache-allgather` rule). `names` spells the settings in the reason."""
    if not settings.offload.enable_runtime_cache:
        return RuntimeCacheResult(
            None, f"the runtime cache is off ({names('offload.enable_runtime_cache')})")
    tensors = {name: t.detach() for name, t in runtime_tensors(dit).items()}
    problem = layout_problem(tensors, dit)
    if problem:
        return RuntimeCacheResult(None, f"layout not cacheable: {problem}")
    digest = content_digest(tensors)
    identity = runtime_identity(layout.identity(tensors), digest)
    eid = entry_id(identity)
    try:
        published = _publish(settings, eid, identity, tensors, shard_bytes)
        plan = _map_back(settings, eid, tensors, digest)
    except DloError as exc:
        logger.warning("runtime cache entry %s not used, keeping ordinary tensors: %s", eid, exc)
        return RuntimeCacheResult(None, str(exc), eid)
    logger.info("runtime cache entry %s %s", eid, "published" if published else "joined")
    return RuntimeCacheResult(plan, None, eid, published)


def _publish(settings: Settings, eid: str, identity: dict[str, object],
             tensors: dict[str, torch.Tensor], shard_bytes: int) -> bool:
    """Write the entry unless a valid one is there already; True when this process wrote it."""
    total = sum(t.nbytes for t in tensors.values())
    with begin_publication(
        settings.runtime_cache_root, eid, expected_bytes=total + _HEADER_SLACK,
        lock_timeout_s=settings.offload.runtime_cache_lock_timeout_s,
        min_free_bytes=settings.cache.min_free_bytes,
    ) as pub:
        if pub.existing is not None:
            return False
        shards = _shards(tensors, shard_bytes)
        records = []
        for index, names in enumerate(shards, start=1):
            name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
            size = write_safetensors(pub.tmp_dir / name, {n: tensors[n] for n in names})
            records.append(FileRecord(name, size))
        pub.commit("runtime", identity, records, tensor_count=len(tensors),
                   content_digest=identity["content_digest"], producer="dlo-runtime-cache")
        return True


def _shards(tensors: dict[str, torch.Tensor], shard_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    used = 0
    for name in sorted(tensors):
        size = tensors[name].nbytes
        if shards[-1] and used + size > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def _map_back(settings: Settings, eid: str, tensors: dict[str, torch.Tensor],
              digest: str) -> HostWeightPlan:
    """Map the entry and prove its tensors are the ordinary ones before returning a plan."""
    handle = open_entry(settings.runtime_cache_root, eid, verify=settings.cache.verify)
    source = MappedEntry(handle.path, handle=handle)
    try:
        bindings = [
            TensorBinding(name=key, file=record.name, offset=stored.offset, dtype=stored.dtype,
                          shape=stored.shape)
            for record in handle.manifest.files
            for key, stored in read_header(handle.path / record.name).items()
        ]
        plan = HostWeightPlan(backing_kind=BackingKind.RUNTIME_CACHE, bindings=bindings,
                              covered_prefixes=[r.name for r in handle.manifest.files],
                              source=source)
        mapped = plan.source_views()
        if set(mapped) != set(tensors) or content_digest(mapped) != digest:
            raise RuntimeCacheMismatch(
                f"runtime cache entry {eid} does not hold this process's tensors (content digest "
                "mismatch after mapping)",
                hint="remove the damaged entry: "
                     + remove_command(eid, settings.runtime_cache_root),
            )
    except BaseException:
        source.close()
        raise
    return plan

