"""The one validator of the settings document, and the DLO group selection rule.

Called by the operator (a CR that fails gets `Valid=False` and no children), by the runtime at
startup and by the loader. Single-field bounds come from the schema's declarations
(`dlo_contract.settings`); `RULES` are the combinations the DLO design rejects. The CRD mirrors
`RULES` as CEL expressions with the same ids (`dlo_contract/crd_rules.yaml`); a test evaluates
both over the whole compatibility matrix, so change them together.

Messages name each field as its reader wrote it: the document path (`offload.use_allgather`) by
default, the CR path (`spec.offload.useAllgather`) for the operator, and both when the document
records that the operator rendered it from a CR (`Settings.origin`). Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from dlo_contract.field_names import Names, document_names
from dlo_contract.schema import leaves
from dlo_contract.settings import Settings, SettingsError
from dlo_contract.source_uri import endpoint_problem, shown_source, source_problem

QUANT_NONE = "none"
QUANT_FP8_PER_TENSOR = "fp8_per_tensor"

CR_PATHS: dict[str, str] = {leaf.path: leaf.meta.crd for leaf in leaves(Settings)
                            if leaf.meta.crd is not None}
"""Document path -> path under the CR's `spec`, from the schema's `crd` declarations."""


def cr_names(path: str) -> str:
    """The CR path the user wrote (`spec.offload.useAllgather`)."""
    return f"spec.{CR_PATHS[path]}" if path in CR_PATHS else path


def names_for(settings: Settings) -> Names:
    """How messages about `settings` name fields: as the user wrote them, the CR path when the
    operator rendered the document from a CR (`settings.origin`), else the document path. Each
    plane calls it once on its validated settings and hands the namer down."""
    return cr_names if settings.origin else document_names


@dataclass(frozen=True)
class Rule:
    """One rejected combination: `check` returns True when `settings` violates it. `message`
    and `fix` name fields through `n` (see `Names`)."""

    id: str
    fields: tuple[str, ...]
    check: Callable[[Settings], bool]
    message: Callable[[Settings, Names], str]
    fix: Callable[[Names], str]


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
        lambda s, n: "HSDP with DLO AllGather would shard parameters twice",
        lambda n: f"set {n('offload.use_allgather')}=false (HSDP then keeps rank-local tensors)",
    ),
    Rule(
        "resident-layers-allgather",
        ("offload.resident_layers", "offload.use_allgather"),
        lambda s: _ag(s) and s.offload.resident_layers > 0,
        lambda s, n: f"{n('offload.resident_layers')}={s.offload.resident_layers} "
        "needs rank-local blocks",
        lambda n: f"set {n('offload.use_allgather')}=false or {n('offload.resident_layers')}=0",
    ),
    Rule(
        "quantization-allgather",
        ("quantization", "offload.use_allgather"),
        lambda s: _ag(s) and s.quantization not in (QUANT_NONE, QUANT_FP8_PER_TENSOR),
        lambda s, n: f"{n('quantization')}={s.quantization!r} has no validated shard layout "
        "for AllGather",
        lambda n: f"use {n('quantization')}={QUANT_FP8_PER_TENSOR!r} or {QUANT_NONE!r}, "
        f"or set {n('offload.use_allgather')}=false",
    ),
    Rule(
        "runtime-cache-allgather",
        ("offload.enable_runtime_cache", "offload.use_allgather"),
        lambda s: _ag(s) and s.offload.enable_runtime_cache,
        lambda s, n: "the runtime cache holds whole rank-local tensors, AllGather holds shards",
        lambda n: f"set {n('offload.use_allgather')}=false or "
        f"{n('offload.enable_runtime_cache')}=false",
    ),
    Rule(
        "runtime-cache-quantization",
        ("offload.enable_runtime_cache", "quantization"),
        lambda s: _rc(s) and s.quantization != QUANT_NONE,
        lambda s, n: f"the runtime cache rejects {n('quantization')}={s.quantization!r}",
        lambda n: f"set {n('quantization')}={QUANT_NONE!r} or "
        f"{n('offload.enable_runtime_cache')}=false",
    ),
    Rule(
        "runtime-cache-hsdp",
        ("offload.enable_runtime_cache", "parallel.hsdp"),
        lambda s: _rc(s) and s.parallel.hsdp,
        lambda s, n: "the runtime cache cannot hold HSDP (DTensor) parameters",
        lambda n: f"set {n('parallel.hsdp')}=false or {n('offload.enable_runtime_cache')}=false",
    ),
    Rule(
        "runtime-cache-ep",
        ("offload.enable_runtime_cache", "parallel.ep"),
        lambda s: _rc(s) and s.parallel.ep > 1,
        lambda s, n: "the runtime cache rejects expert parallelism "
        f"({n('parallel.ep')}={s.parallel.ep})",
        lambda n: f"set {n('parallel.ep')}=1 or {n('offload.enable_runtime_cache')}=false",
    ),
    Rule(
        "runtime-cache-cfg-parallel",
        ("offload.enable_runtime_cache", "parallel.cfg_parallel"),
        lambda s: _rc(s) and s.parallel.cfg_parallel > 1,
        lambda s, n: "the runtime cache rejects CFG parallelism "
        f"({n('parallel.cfg_parallel')}={s.parallel.cfg_parallel})",
        lambda n: f"set {n('parallel.cfg_parallel')}=1 or "
        f"{n('offload.enable_runtime_cache')}=false",
    ),
    Rule(
        "runtime-cache-pp",
        ("offload.enable_runtime_cache", "parallel.pp"),
        lambda s: _rc(s) and s.parallel.pp > 1,
        lambda s, n: "the runtime cache rejects pipeline parallelism "
        f"({n('parallel.pp')}={s.parallel.pp})",
        lambda n: f"set {n('parallel.pp')}=1 or {n('offload.enable_runtime_cache')}=false",
    ),
    Rule(
        "pin-limit-needs-runtime-cache",
        ("offload.runtime_cache_pin_limit_gib", "offload.enable_runtime_cache"),
        lambda s: _dlo(s)
        and s.offload.runtime_cache_pin_limit_gib > 0
        and not s.offload.enable_runtime_cache,
        lambda s, n: f"{n('offload.runtime_cache_pin_limit_gib')}="
        f"{s.offload.runtime_cache_pin_limit_gib:g} registers the runtime-cache mapping, "
        "which is off",
        lambda n: f"set {n('offload.enable_runtime_cache')}=true or "
        f"{n('offload.runtime_cache_pin_limit_gib')}=0",
    ),
    Rule(
        "hsdp-with-dp-or-tp",
        ("parallel.hsdp", "parallel.dp", "parallel.tp"),
        lambda s: s.parallel.hsdp and (s.parallel.dp > 1 or s.parallel.tp > 1),
        lambda s, n: f"HSDP cannot combine with {n('parallel.dp')}={s.parallel.dp} "
        f"or {n('parallel.tp')}={s.parallel.tp}",
        lambda n: f"set {n('parallel.dp')}=1 and {n('parallel.tp')}=1, "
        f"or {n('parallel.hsdp')}=false",
    ),
)

LOADER_MEMORY_RULE = "loader-memory-two-chunks"
"""The one cross-field bound outside `RULES` (its CEL twin has this id)."""


def _get(settings: Any, dotted: str) -> Any:
    value = settings
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def range_errors(settings: Settings, names: Names = document_names) -> list[str]:
    """Single-field bounds declared in the schema (the CRD states them as `minimum`/`enum`),
    the source URI's and the endpoint's forms (`source_uri`; an empty source is left to whoever
    requires one) and the loader's double-buffering bound."""
    errors = []
    for leaf in leaves(Settings):
        value = _get(settings, leaf.path)
        problem = None if value is None else leaf.meta.bounds.problem(value)
        if problem is not None and not leaf.meta.required:
            errors.append(f"{names(leaf.path)}={value!r} {problem}")
    source, endpoint = settings.loader.source, settings.loader.endpoint_url
    if source and (problem := source_problem(source)):
        errors.append(f"{names('loader.source')}={shown_source(source)!r} {problem}")
    if endpoint and (problem := endpoint_problem(endpoint)):
        errors.append(f"{names('loader.endpoint_url')}={shown_source(endpoint)!r} {problem}")
    if settings.loader.chunk_bytes * 2 > settings.loader.memory_limit_bytes:
        errors.append(
            f"{names('loader.memory_limit_bytes')}={settings.loader.memory_limit_bytes} must "
            f"hold two chunks of {names('loader.chunk_bytes')}={settings.loader.chunk_bytes} "
            "(double buffering)"
        )
    return errors


def violated_rules(settings: Settings) -> list[Rule]:
    """The compatibility-matrix rows `settings` violates, in `RULES` order."""
    return [rule for rule in RULES if rule.check(settings)]


def validate(settings: Settings, names: Names | None = None) -> Settings:
    """Reject bad values and unsupported combinations; return the normalized document.

    `names` picks how messages name fields; by default the document path, or, when the operator
    rendered the document from a CR (`settings.origin`), the CR path followed by a key to the
    document paths. Normalization only turns off the offload strategies that DLO replaces (model-level and
    standard layerwise CPU offload), because DLO takes priority over them.
    """
    named: list[str] = []
    if names is None:
        chosen = names_for(settings)

        def names(path: str) -> str:
            named.append(path)
            return chosen(path)
    errors = range_errors(settings, names)
    errors += [
        f"{', '.join(map(names, rule.fields))}: {rule.message(settings, names)} [{rule.id}]; "
        f"fix: {rule.fix(names)}"
        for rule in violated_rules(settings)
    ]
    if errors:
        message = "invalid settings: " + "; ".join(errors)
        if settings.origin:
            key = ", ".join(f"{cr_names(p)} is {p}" for p in dict.fromkeys(named))
            message += f" (document rendered from {settings.origin}; in the document {key})"
        raise SettingsError(message)
    if settings.offload.enabled and (
        settings.offload.model_cpu_offload or settings.offload.layerwise_cpu_offload
    ):
        offload = settings.offload.model_copy(
            update={"model_cpu_offload": False, "layerwise_cpu_offload": False})
        return settings.model_copy(update={"offload": offload})
    return settings


@dataclass(frozen=True)
class GroupChoice:
    """The placement decision: which existing process group DLO shards host weights over, made
    once from the validated settings (`select_group`); the runtime consumes it and does not read
    `offload.use_allgather` again."""

    kind: Literal["dp", "sp", "none"]
    shard_count: int
    """Ranks of the chosen group (G): each block is split in G shards, one per rank; 1 for
    rank-local blocks."""
    allgather_asked: bool = False
    """The settings ask for AllGather (`offload.use_allgather` with DLO on), whether or not a
    group of more than one rank was found: a group passed in must then be the chosen one."""


def select_group(settings: Settings) -> GroupChoice:
    """DP group if dp > 1, else SP group if sp > 1, else none; never TP.
    `use_allgather=false` forces the shard count to 1 (rank-local blocks)."""
    if not settings.offload.enabled or not settings.offload.use_allgather:
        return GroupChoice("none", 1)
    if settings.parallel.dp > 1:
        return GroupChoice("dp", settings.parallel.dp, allgather_asked=True)
    if settings.parallel.sp > 1:
        return GroupChoice("sp", settings.parallel.sp, allgather_asked=True)
    return GroupChoice("none", 1, allgather_asked=True)
