"""Which modules of a DiT are streamed block by block, which come in on demand, and which stay.

Owns `OffloadPlan`, the built-in plans for the diffusers transformers users run most (Flux, SD3,
Wan), the way a model declares its own plan, and the heuristic used when neither applies.
Called by `dlo_runtime.discovery`; it only names paths and must not touch tensors, devices or
process groups.

A model declares its plan with a class attribute (or a method taking no argument) named
`_dlo_offload_plan`, holding either an `OffloadPlan` or a plain mapping, so that a model package
needs no import of this one::

    class MyDiT(nn.Module):
        _dlo_offload_plan = {"blocks": ["double_blocks", "single_blocks"],
                             "resident": ["double_blocks"],
                             "on_demand": ["context_refiner"]}

`blocks` are streamed through the device slots; `resident` narrows which block lists may keep
their leading blocks on the device (`offload.resident_layers`); `on_demand` names modules outside
the block lists (a large embedding, a refiner that runs once per request) whose weights stay in
host memory and are copied to the device only while that module runs: a forward pre-hook copies
them in on the compute stream, a forward hook puts placeholders back (see
`dlo_runtime.on_demand`). Every other module of the DiT stays resident on the device. On-demand
modules are rank-local in AllGather mode too: each rank keeps their whole tensors in host memory
and copies them without a collective, so they cost their full size on every rank.

Precedence: the model's declaration, then the built-in plan for its class name, then the
heuristic: every `nn.ModuleList` of same-class children among those holding the bulk of the
weights (`BULK_SHARE`), whose run order the backend learns from the first forward.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from torch import nn

from dlo_runtime.errors import OffloadPlanError

PLAN_ATTRIBUTE = "_dlo_offload_plan"
PLAN_KEYS = ("blocks", "resident", "on_demand")
"""Keys of a declared plan mapping, as the fields of `OffloadPlan` they fill."""
PlanSource = Literal["declared", "builtin", "heuristic"]


@dataclass(frozen=True, kw_only=True)
class OffloadPlan:
    """Block lists of a DiT, in the order its forward runs them, and its on-demand modules."""

    blocks: tuple[str, ...]
    """Dotted paths (relative to the DiT) of `nn.ModuleList`s whose children are streamed one
    block at a time, in execution order. Everything outside them and `on_demand` stays resident
    on the device."""
    resident: tuple[str, ...] = ()
    """Block lists whose leading blocks may be kept on the device (`offload.resident_layers`).
    Empty means every list in `blocks` is eligible."""
    on_demand: tuple[str, ...] = ()
    """Dotted paths of modules outside the block lists whose weights stay in host memory and are
    brought to the device only while the module runs. They must not overlap one another."""
    source: PlanSource = "declared"
    """Where the plan came from; reported in logs so that a surprising plan can be traced."""

    def __post_init__(self) -> None:
        if not self.blocks:
            raise OffloadPlanError(
                "offload plan: blocks is empty; name at least one nn.ModuleList of DiT blocks"
            )
        stray = sorted(set(self.resident) - set(self.blocks))
        if stray:
            raise OffloadPlanError(
                f"offload plan: resident path(s) {', '.join(stray)} are not block lists; "
                f"allowed: {', '.join(self.blocks)}"
            )
        for path in self.on_demand:
            for block_list in self.blocks:
                if _overlaps(path, block_list):
                    raise OffloadPlanError(
                        f"offload plan: on_demand path {path!r} overlaps block list "
                        f"{block_list!r}; name modules outside the block lists"
                    )
        for position, path in enumerate(self.on_demand):
            for other in self.on_demand[position + 1 :]:
                if _overlaps(path, other):
                    raise OffloadPlanError(
                        f"offload plan: on_demand paths {path!r} and {other!r} overlap; "
                        "name each module once, and no module inside another"
                    )

    @property
    def resident_lists(self) -> tuple[str, ...]:
        return self.resident or self.blocks


def _overlaps(first: str, second: str) -> bool:
    """Whether one dotted module path is the other or lies inside it ('' is the DiT itself)."""
    return any(
        inner == outer or outer == "" or inner.startswith(outer + ".")
        for outer, inner in ((first, second), (second, first))
    )


BUILTIN_PLANS: dict[str, OffloadPlan] = {
    "FluxTransformer2DModel": OffloadPlan(
        blocks=("transformer_blocks", "single_transformer_blocks"), source="builtin"
    ),
    "SD3Transformer2DModel": OffloadPlan(blocks=("transformer_blocks",), source="builtin"),
    "WanTransformer3DModel": OffloadPlan(blocks=("blocks",), source="builtin"),
}
"""Keyed by class name so that this module needs no diffusers import."""


def plan_for(dit: nn.Module) -> OffloadPlan:
    """The plan of `dit`: its own declaration, else the built-in one, else the heuristic."""
    declared = getattr(type(dit), PLAN_ATTRIBUTE, None)
    if declared is not None:
        value = getattr(dit, PLAN_ATTRIBUTE)
        return _coerce(value() if callable(value) else value, type(dit).__name__)
    builtin = BUILTIN_PLANS.get(type(dit).__name__)
    if builtin is not None:
        return builtin
    return heuristic_plan(dit)


def _coerce(value: Any, owner: str) -> OffloadPlan:
    if isinstance(value, OffloadPlan):
        return value
    if not isinstance(value, Mapping):
        raise OffloadPlanError(
            f"{owner}.{PLAN_ATTRIBUTE} is a {type(value).__name__}; "
            "expected an OffloadPlan or a mapping with 'blocks' (and optionally 'resident', "
            "'on_demand')"
        )
    unknown = sorted(set(value) - set(PLAN_KEYS))
    if unknown:
        raise OffloadPlanError(
            f"{owner}.{PLAN_ATTRIBUTE}: unknown key(s) {', '.join(unknown)}; "
            f"allowed: {', '.join(PLAN_KEYS)}"
        )
    return OffloadPlan(
        blocks=_paths(value.get("blocks", ()), owner, "blocks"),
        resident=_paths(value.get("resident", ()), owner, "resident"),
        on_demand=_paths(value.get("on_demand", ()), owner, "on_demand"),
        source="declared",
    )


def _paths(value: Any, owner: str, key: str) -> tuple[str, ...]:
    if isinstance(value, str) or not all(isinstance(v, str) for v in value):
        raise OffloadPlanError(
            f"{owner}.{PLAN_ATTRIBUTE}[{key!r}] must be a list of dotted module paths, "
            f"found {value!r}"
        )
    return tuple(value)


BULK_SHARE = 0.9
"""The heuristic streams block lists, largest first, until they hold this share of the bytes of
all candidate lists; the small lists left (a token refiner, a motion encoder) stay resident."""


def weight_bytes(module: nn.Module) -> int:
    """Bytes of the parameters and persistent buffers under `module` (meta ones included: their
    shapes are known before any weight is loaded)."""
    tensors = {id(t): t for t in module.state_dict(keep_vars=True).values()}  # tied ones once
    return sum(t.numel() * t.element_size() for t in tensors.values())


def block_lists(dit: nn.Module) -> list[tuple[str, int]]:
    """`(path, weight bytes)` of every `nn.ModuleList` of two or more same-class children that
    lies inside no other such list, in declaration order."""
    found: list[tuple[str, int]] = []
    for path, module in dit.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        if len({type(child) for child in module}) != 1:
            continue
        if any(path.startswith(outer + ".") for outer, _ in found):
            continue  # a list inside a block (attention outputs, experts) streams with its block
        found.append((path, weight_bytes(module)))
    return found


def heuristic_plan(dit: nn.Module) -> OffloadPlan:
    """Every list of same-class blocks that, taken largest first, together hold `BULK_SHARE` of
    the bytes of all such lists, in declaration order. The order the forward runs their blocks is
    learned from the first forward (see `dlo_runtime.execution_order`)."""
    candidates = block_lists(dit)
    if not candidates:
        raise OffloadPlanError(
            f"{type(dit).__name__} has no nn.ModuleList of two or more blocks of one class; "
            f"declare the block lists with a class attribute {PLAN_ATTRIBUTE} = "
            "{'blocks': ['<path>', ...]}"
        )
    total = sum(size for _, size in candidates)
    chosen: set[str] = set()
    held = 0
    for path, size in sorted(candidates, key=lambda c: -c[1]):
        if chosen and held >= BULK_SHARE * total:
            break
        chosen.add(path)
        held += size
    return OffloadPlan(
        blocks=tuple(path for path, _ in candidates if path in chosen), source="heuristic"
    )
