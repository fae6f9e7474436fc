"""The one validator of the settings document, and the DLO group selection rule.

Called by the operator (a CR that fails gets `Valid=False` and no children), by the runtime at
startup and by the loader. The CRD mirrors `RULES` as CEL expressions with the same ids; a test
evaluates both over the whole compatibility matrix of the DLO design, so change them together.
Torch-free.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from dlo_contract.settings import Settings, SettingsError

QUANT_NONE = "none"
QUANT_FP8_PER_TENSOR = "fp8_per_tensor"


@dataclass(frozen=True)
class Rule:
    """One rejected combination: `check` returns True when `settings` violates it."""

    id: str
    fields: tuple[str, ...]
    check: Callable[[Settings], bool]
    message: Callable[[Settings], str]
    fix: str


def _dlo(s: Settings) -> bool:
    return s.offload.enabled


def _ag(s: Settings) -> bool:
    return s.offload.enabled and s.offload.use_allgather


def _rc(s: Settings) -> bool:
    return s.offload.enabled and s.offload.enable_runtime_cache


RULES: tuple[Rule, ...] = (
    Rule(
        "hsdp-allgather",
        ("parallel.hsdp", "offload.use_allgather"),
        lambda s: _ag(s) and s.parallel.hsdp,
        lambda s: "HSDP with DLO AllGather would shard parameters twice",
        "set offload.use_allgather=false (HSDP then keeps rank-local tensors)",
    ),
    Rule(
        "resident-layers-allgather",
        ("offload.resident_layers", "offload.use_allgather"),
        lambda s: _ag(s) and s.offload.resident_layers > 0,
        lambda s: f"offload.resident_layers={s.offload.resident_layers} needs rank-local blocks",
        "set offload.use_allgather=false or offload.resident_layers=0",
    ),
    Rule(
        "quantization-allgather",
        ("quantization", "offload.use_allgather"),
        lambda s: _ag(s) and s.quantization not in (QUANT_NONE, QUANT_FP8_PER_TENSOR),
        lambda s: f"quantization={s.quantization!r} has no validated shard layout for AllGather",
        f"use quantization={QUANT_FP8_PER_TENSOR!r} or {QUANT_NONE!r}, "
        "or set offload.use_allgather=false",
    ),
    Rule(
        "runtime-cache-allgather",
        ("offload.enable_runtime_cache", "offload.use_allgather"),
        lambda s: _ag(s) and s.offload.enable_runtime_cache,
        lambda s: "the runtime cache holds whole rank-local tensors, AllGather holds shards",
        "set offload.use_allgather=false or offload.enable_runtime_cache=false",
    ),
    Rule(
        "runtime-cache-quantization",
        ("offload.enable_runtime_cache", "quantization"),
        lambda s: _rc(s) and s.quantization != QUANT_NONE,
        lambda s: f"the runtime cache rejects quantization={s.quantization!r}",
        f"set quantization={QUANT_NONE!r} or offload.enable_runtime_cache=false",
    ),
    Rule(
        "runtime-cache-hsdp",
        ("offload.enable_runtime_cache", "parallel.hsdp"),
        lambda s: _rc(s) and s.parallel.hsdp,
        lambda s: "the runtime cache cannot hold HSDP (DTensor) parameters",
        "set parallel.hsdp=false or offload.enable_runtime_cache=false",
    ),
    Rule(
        "runtime-cache-ep",
        ("offload.enable_runtime_cache", "parallel.ep"),
        lambda s: _rc(s) and s.parallel.ep > 1,
        lambda s: f"the runtime cache rejects expert parallelism (parallel.ep={s.parallel.ep})",
        "set parallel.ep=1 or offload.enable_runtime_cache=false",
    ),
    Rule(
        "runtime-cache-cfg-parallel",
        ("offload.enable_runtime_cache", "parallel.cfg_parallel"),
        lambda s: _rc(s) and s.parallel.cfg_parallel > 1,
        lambda s: "the runtime cache rejects CFG parallelism "
        f"(parallel.cfg_parallel={s.parallel.cfg_parallel})",
        "set parallel.cfg_parallel=1 or offload.enable_runtime_cache=false",
    ),
    Rule(
        "runtime-cache-pp",
        ("offload.enable_runtime_cache", "parallel.pp"),
        lambda s: _rc(s) and s.parallel.pp > 1,
        lambda s: f"the runtime cache rejects pipeline parallelism (parallel.pp={s.parallel.pp})",
        "set parallel.pp=1 or offload.enable_runtime_cache=false",
    ),
    Rule(
        "pin-limit-needs-runtime-cache",
        ("offload.runtime_cache_pin_limit_gib", "offload.enable_runtime_cache"),
        lambda s: _dlo(s)
        and s.offload.runtime_cache_pin_limit_gib > 0
        and not s.offload.enable_runtime_cache,
        lambda s: "offload.runtime_cache_pin_limit_gib="
        f"{s.offload.runtime_cache_pin_limit_gib:g} registers the runtime-cache mapping, "
        "which is off",
        "set offload.enable_runtime_cache=true or offload.runtime_cache_pin_limit_gib=0",
    ),
    Rule(
        "hsdp-with-dp-or-tp",
        ("parallel.hsdp", "parallel.dp", "parallel.tp"),
        lambda s: s.parallel.hsdp and (s.parallel.dp > 1 or s.parallel.tp > 1),
        lambda s: f"HSDP cannot combine with parallel.dp={s.parallel.dp} "
        f"or parallel.tp={s.parallel.tp}",
        "set parallel.dp=1 and parallel.tp=1, or parallel.hsdp=false",
    ),
)

_POSITIVE_INTS = (
    "parallel.dp", "parallel.sp", "parallel.tp", "parallel.pp", "parallel.ep",
    "loader.readers", "loader.chunk_bytes", "loader.memory_limit_bytes", "loader.max_retries",
)
_POSITIVE_FLOATS = (
    "offload.runtime_cache_lock_timeout_s", "loader.rendezvous_timeout_s", "loader.timeout_s",
    "loader.stall_timeout_s",
)
_NON_NEGATIVE = (
    "offload.resident_layers", "offload.runtime_cache_pin_limit_gib",
    "cache.max_bytes", "cache.min_free_bytes",
)


def _get(settings: Settings, dotted: str) -> object:
    value: object = settings
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def range_errors(settings: Settings) -> list[str]:
    """Single-field bounds (the CRD expresses these as `minimum`/`enum`)."""
    errors = []
    for name in _POSITIVE_INTS + _POSITIVE_FLOATS:
        if _get(settings, name) <= 0:  # type: ignore[operator]
            errors.append(f"{name}={_get(settings, name)!r} must be greater than 0")
    for name in _NON_NEGATIVE:
        if _get(settings, name) < 0:  # type: ignore[operator]
            errors.append(f"{name}={_get(settings, name)!r} must be 0 or more")
    if settings.parallel.cfg_parallel not in (1, 2):
        errors.append(f"parallel.cfg_parallel={settings.parallel.cfg_parallel!r} must be 1 or 2")
    if not settings.quantization:
        errors.append(f"quantization must name a method or {QUANT_NONE!r}")
    if settings.loader.chunk_bytes * 2 > settings.loader.memory_limit_bytes:
        errors.append(
            f"loader.memory_limit_bytes={settings.loader.memory_limit_bytes} must hold two "
            f"chunks of loader.chunk_bytes={settings.loader.chunk_bytes} (double buffering)"
        )
    return errors


def violated_rules(settings: Settings) -> list[Rule]:
    """The compatibility-matrix rows `settings` violates, in `RULES` order."""
    return [rule for rule in RULES if rule.check(settings)]


def validate(settings: Settings) -> Settings:
    """Reject bad values and unsupported combinations; return the normalized document.

    Normalization only turns off the offload strategies that DLO replaces (model-level and
    standard layerwise CPU offload), because DLO takes priority over them.
    """
    errors = range_errors(settings)
    errors += [
        f"{', '.join(rule.fields)}: {rule.message(settings)} [{rule.id}]; fix: {rule.fix}"
        for rule in violated_rules(settings)
    ]
    if errors:
        raise SettingsError("invalid settings: " + "; ".join(errors))
    if settings.offload.enabled and (
        settings.offload.model_cpu_offload or settings.offload.layerwise_cpu_offload
    ):
        offload = dataclasses.replace(
            settings.offload, model_cpu_offload=False, layerwise_cpu_offload=False
        )
        return dataclasses.replace(settings, offload=offload)
    return settings


@dataclass(frozen=True)
class GroupChoice:
    """Which existing process group DLO shards host weights over, and the shard count."""

    kind: Literal["dp", "sp", "none"]
    shard_size: int

    @property
    def uses_allgather(self) -> bool:
        return self.shard_size > 1


def select_group(settings: Settings) -> GroupChoice:
    """DP group if dp > 1, else SP group if sp > 1, else none; never TP.
    `use_allgather=false` forces the shard size to 1 (rank-local blocks)."""
    if not settings.offload.enabled or not settings.offload.use_allgather:
        return GroupChoice("none", 1)
    if settings.parallel.dp > 1:
        return GroupChoice("dp", settings.parallel.dp)
    if settings.parallel.sp > 1:
        return GroupChoice("sp", settings.parallel.sp)
    return GroupChoice("none", 1)
