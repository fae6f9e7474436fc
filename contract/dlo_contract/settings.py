"""The settings document: one typed JSON file read by the loader and the runtime.

The operator normalizes a `DiffusionOffloadDeployment` spec into this document and mounts it into
every container of the pod (path in `DLO_CONFIG`). Field names follow the DLO design
(`OffloadConfig` and its options). This module parses and serializes the document; the rules that
reject combinations live in `dlo_contract.validation`. It must import nothing outside the standard
library: the operator image has no torch.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dlo_contract.errors import PermanentError
from dlo_contract.names import CONFIG_ENV, DEFAULT_CACHE_ROOT, DEFAULT_CONFIG_PATH

SCHEMA_VERSION = 1
MIB = 1 << 20
GIB = 1 << 30

LoaderMode = Literal["multi-reader", "single-reader", "independent"]
RendezvousFallback = Literal["independent", "fail"]
VerifyMode = Literal["sizes", "full"]
DistBackend = Literal["gloo", "nccl"]


class SettingsError(PermanentError):
    """The settings document cannot be parsed, or names a value that is not allowed."""


@dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """Distributed Layerwise Offload policy (names follow the DLO design document)."""

    enabled: bool = True
    """Stream DiT blocks through two device slots; off means the model stays resident."""
    use_allgather: bool = True
    """Keep 1/G of each block per rank and rebuild it with AllGather over the DP (else SP) group.
    False streams whole rank-local blocks and forces the shard size to 1."""
    resident_layers: int = 0
    """Leading blocks kept on the device, never streamed. Rank-local (no-AllGather) mode only."""
    enable_runtime_cache: bool = False
    """Publish the ordinary loader's final DiT tensors as a node-cache entry and map them
    (Phase B). No-AllGather only; off by default because it costs a full hash pass per rank."""
    runtime_cache_root: str | None = None
    """Node-cache root for runtime entries; None means the `cache.root` of this document."""
    runtime_cache_lock_timeout_s: float = 600.0
    """Seconds to wait for another process publishing the same runtime entry before keeping the
    ordinary tensors. Ten minutes covers hashing a large DiT on a busy node."""
    runtime_cache_pin_limit_gib: float = 0.0
    """Per-process budget (GiB) for registering the runtime-cache mapping with the device
    runtime; 0 turns registration off and keeps the two bounded staging slots."""
    model_cpu_offload: bool = False
    """Model-level CPU offload. DLO takes priority: forced off while DLO is enabled."""
    layerwise_cpu_offload: bool = False
    """Standard (non-distributed) layerwise CPU offload. Forced off while DLO is enabled."""


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """The parallel topology the inference engine already runs; DLO never creates groups."""

    dp: int = 1
    """Data-parallel size: independent replicas; the first choice for DLO weight sharding."""
    sp: int = 1
    """Sequence-parallel size; the DLO sharding group when dp is 1."""
    tp: int = 1
    """Tensor-parallel size; never used as the DLO group."""
    hsdp: bool = False
    """Hybrid-sharded data parallel owns parameter sharding itself."""
    cfg_parallel: int = 1
    """Classifier-free-guidance parallel size (1 or 2)."""
    pp: int = 1
    """Pipeline-parallel size."""
    ep: int = 1
    """Expert-parallel size."""


@dataclass(frozen=True, kw_only=True)
class LoaderConfig:
    """How the init container streams the checkpoint from object storage into the node cache."""

    source: str = ""
    """Object-store URI of the checkpoint prefix, e.g. `s3://models/flux-dev/`."""
    include: tuple[str, ...] = ("*.safetensors", "*.json")
    """Glob patterns (relative to the source prefix) of the objects to fetch."""
    endpoint_url: str | None = None
    """S3 endpoint; None uses the SDK's default for the region."""
    region: str | None = None
    """S3 region; None uses the SDK's default chain."""
    path_style: bool = False
    """Path-style addressing (`endpoint/bucket/key`), needed by most S3-compatible servers."""
    mode: LoaderMode = "multi-reader"
    """`multi-reader`: each of N loaders reads ~1/N and peers exchange the rest;
    `single-reader`: rank 0 reads, the rest receive; `independent`: every node reads everything."""
    readers: int = 16
    """Concurrent ranged GETs per loader; enough to fill a 10+ Gbit/s link with 16 MiB chunks."""
    chunk_bytes: int = 16 * MIB
    """Unit of planning, fetching, hashing and exchange."""
    rendezvous_timeout_s: float = 300.0
    """Seconds to wait for all N loaders to join before applying `on_rendezvous_timeout`."""
    on_rendezvous_timeout: RendezvousFallback = "independent"
    """`independent`: read everything alone; `fail`: exit non-zero."""
    memory_limit_bytes: int = 1 * GIB
    """Upper bound on in-flight chunk buffers (fetch plus exchange) per loader."""
    backend: DistBackend = "gloo"
    """torch.distributed backend for the peer exchange."""
    max_retries: int = 8
    """Attempts per ranged GET on throttling, 5xx, resets and short bodies."""
    timeout_s: float = 3600.0
    """Whole-fill deadline; any rank past it fails every rank."""


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """The node's content-addressed cache (hostPath), shared by every pod on the node."""

    root: str = DEFAULT_CACHE_ROOT
    """Directory holding `v1/`; a hostPath in Kubernetes."""
    max_bytes: int = 0
    """Upper bound on the bytes of all entries; 0 means no limit. Enforced by LRU eviction."""
    min_free_bytes: int = 0
    """Free space to keep on the cache filesystem; eviction runs until it holds."""
    verify: VerifyMode = "sizes"
    """How readers check an entry: `sizes` (manifest and file sizes) or `full` (re-hash)."""


@dataclass(frozen=True, kw_only=True)
class Settings:
    """The whole document. `schema_version` lets a newer reader refuse an older writer."""

    schema_version: int = SCHEMA_VERSION
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    quantization: str = "none"
    """`none`, `fp8_per_tensor`, or another online quantization method's name."""
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)

    @property
    def runtime_cache_root(self) -> str:
        return self.offload.runtime_cache_root or self.cache.root

    def to_dict(self) -> dict[str, Any]:
        return _to_plain(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: Any) -> Settings:
        return _from_plain(cls, data, "")

    @classmethod
    def from_json(cls, text: str) -> Settings:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SettingsError(f"settings document is not valid JSON: {exc}") from exc
        return cls.from_dict(data)


def load_settings(path: str | os.PathLike[str] | None = None) -> Settings:
    """Read the document from `path`, else `$DLO_CONFIG`, else the default mount path."""
    where = Path(path or os.environ.get(CONFIG_ENV) or DEFAULT_CONFIG_PATH)
    try:
        text = where.read_text()
    except OSError as exc:
        raise SettingsError(
            f"cannot read settings document {where}: {exc.strerror}",
            hint=f"pass --config FILE or set {CONFIG_ENV}",
        ) from exc
    return Settings.from_json(text)


def replace_path(settings: Settings, dotted: str, value: Any) -> Settings:
    """Return `settings` with one field (`loader.mode`, `quantization`, ...) replaced, checked
    like the document itself. Used for command-line overrides."""
    section, _, name = dotted.rpartition(".")
    data = settings.to_dict()
    target = data[section] if section else data
    if name not in target:
        raise SettingsError(f"unknown settings field {dotted!r}")
    target[name] = value
    return Settings.from_dict(data)


def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple):
        return [_to_plain(v) for v in value]
    return value


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    """Resolved field types of a settings dataclass (resolving them is slow; cached per class)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _from_plain(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise SettingsError(
            f"settings{where}: expected an object, found {type(data).__name__}"
        )
    hints = _field_types(cls)
    names = set(hints)
    unknown = sorted(set(data) - names)
    if unknown:
        raise SettingsError(
            f"settings{where}: unknown field(s) {', '.join(unknown)}; "
            f"allowed: {', '.join(sorted(names))}"
        )
    kwargs = {name: _coerce(hints[name], data[name], f"{where}.{name}") for name in data}
    return cls(**kwargs)


def _coerce(hint: Any, value: Any, where: str) -> Any:
    """Check `value` against a field's type; convert JSON lists to tuples and ints to floats."""
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return _from_plain(hint, value, where)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, where)
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            raise SettingsError(
                f"settings{where}: {value!r} is not one of {', '.join(map(repr, allowed))}"
            )
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise SettingsError(f"settings{where}: expected a list of strings, found {value!r}")
        return tuple(value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is bool and not isinstance(value, bool) or (
        hint in (int, float) and isinstance(value, bool)
    ) or not isinstance(value, hint):
        raise SettingsError(
            f"settings{where}: expected {hint.__name__}, found {type(value).__name__} {value!r}"
        )
    return value
