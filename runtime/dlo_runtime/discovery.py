"""Finds the DiT of a pipeline and resolves its offload plan to concrete block modules.

Owns `find_dits` (the one rule for where a pipeline keeps its DiTs) and `ModuleDiscovery`: given
a diffusers pipeline or the DiT itself, it returns the DiT, its `OffloadPlan`, the ordered blocks, split into resident leading
blocks and streamed ones, and the plan's on-demand modules. Called by the DLO backend before it
changes anything; it must not move, copy or repoint tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from dlo_contract.validation import Names, document_names
from dlo_runtime.compiled import uncompiled
from dlo_runtime.offload_plan import OffloadPlan, OffloadPlanError, plan_for


@dataclass(frozen=True)
class Block:
    """One DiT block in execution order."""

    index: int
    """Position among all blocks of the plan (resident ones included)."""
    path: str
    """Dotted path relative to the DiT, e.g. `single_transformer_blocks.2`."""
    list_path: str
    """The block list it belongs to, e.g. `single_transformer_blocks`."""
    module: nn.Module


@dataclass(frozen=True)
class OnDemandModule:
    """A module outside the block lists that is on the device only while it runs."""

    path: str
    """Dotted path relative to the DiT, as declared in the plan's `on_demand`."""
    module: nn.Module


@dataclass(frozen=True)
class DiscoveredModel:
    """The DiT, its plan, and its blocks split by placement."""

    dit: nn.Module
    plan: OffloadPlan
    resident: tuple[Block, ...]
    """Leading blocks kept on the device (`offload.resident_layers`)."""
    streamed: tuple[Block, ...]
    """Blocks streamed through the two device slots, in execution order."""
    on_demand: tuple[OnDemandModule, ...] = ()
    """Modules brought to the device for each call, in the plan's order."""


DIT_ATTRIBUTES = ("transformer", "transformer_2")
"""Pipeline attributes holding DiTs, in order (Wan 2.2 has two experts)."""


def find_dits(target: object) -> list[tuple[str, nn.Module]]:
    """The DiTs of a pipeline as (attribute, module), or `[("transformer", target)]` when
    `target` is itself the DiT. The one rule every caller uses to find DiTs. A DiT that
    `torch.compile(dit)` wrapped is found as the module inside, whose tensors DLO moves."""
    found = [(name, uncompiled(getattr(target, name))) for name in DIT_ATTRIBUTES
             if isinstance(getattr(target, name, None), nn.Module)]
    if found:
        return found
    if isinstance(target, nn.Module):
        return [(DIT_ATTRIBUTES[0], uncompiled(target))]
    raise OffloadPlanError(
        f"cannot find a DiT in {type(target).__name__}: expected an nn.Module or a pipeline "
        f"with one of the attributes {', '.join(DIT_ATTRIBUTES)}"
    )


class ModuleDiscovery:
    """Resolves a pipeline or DiT to a `DiscoveredModel`."""

    def __init__(self, target: object) -> None:
        self.dit = self.find_dit(target)

    @staticmethod
    def find_dit(target: object) -> nn.Module:
        """The one DiT of `target` (see `find_dits`); a pipeline with two DiTs is ambiguous."""
        found = find_dits(target)
        if len(found) > 1:
            raise OffloadPlanError(
                f"{type(target).__name__} has {len(found)} DiTs "
                f"({', '.join(name for name, _ in found)}): a backend offloads one",
                hint="pass each DiT to its own backend, or use dlo_runtime.pod.enable(pipeline)",
            )
        return found[0][1]

    def discover(self, resident_layers: int = 0,
                 name: Names = document_names) -> DiscoveredModel:
        """Blocks of the plan, the first `resident_layers` of them kept resident; errors name
        the setting through `name` (`validation.names_for`: as the user wrote it)."""
        plan = plan_for(self.dit)
        blocks = self._blocks(plan)
        field = name("offload.resident_layers")
        if resident_layers >= len(blocks):
            raise OffloadPlanError(
                f"{field}={resident_layers} leaves no block to stream: "
                f"{type(self.dit).__name__} has {len(blocks)} blocks; "
                f"use at most {len(blocks) - 1}"
            )
        eligible = set(plan.resident_lists)
        for block in blocks[:resident_layers]:
            if block.list_path not in eligible:
                raise OffloadPlanError(
                    f"{field}={resident_layers} would keep {block.path} "
                    f"resident, but the offload plan allows resident blocks only from "
                    f"{', '.join(plan.resident_lists)}; lower {field}"
                )
        return DiscoveredModel(
            dit=self.dit,
            plan=plan,
            resident=tuple(blocks[:resident_layers]),
            streamed=tuple(blocks[resident_layers:]),
            on_demand=self._on_demand(plan),
        )

    def _blocks(self, plan: OffloadPlan) -> list[Block]:
        modules = dict(self.dit.named_modules())
        blocks: list[Block] = []
        seen: set[int] = set()
        for list_path in plan.blocks:
            block_list = modules.get(list_path)
            if not isinstance(block_list, nn.ModuleList):
                found = "nothing" if block_list is None else type(block_list).__name__
                raise OffloadPlanError(
                    f"offload plan of {type(self.dit).__name__} names {list_path!r}, which is "
                    f"{found}; expected an nn.ModuleList of blocks"
                )
            for position, module in enumerate(block_list):
                if id(module) in seen:
                    raise OffloadPlanError(
                        f"offload plan of {type(self.dit).__name__}: block {list_path}.{position} "
                        "appears twice; each block may be listed once"
                    )
                seen.add(id(module))
                blocks.append(Block(len(blocks), f"{list_path}.{position}", list_path, module))
        return blocks

    def _on_demand(self, plan: OffloadPlan) -> tuple[OnDemandModule, ...]:
        modules = dict(self.dit.named_modules())
        found: list[OnDemandModule] = []
        for path in plan.on_demand:
            module = modules.get(path)
            # A container's forward never runs, so its hooks would never bring the weights in.
            if module is None or isinstance(module, (nn.ModuleList, nn.ModuleDict)):
                kind = "nothing" if module is None else type(module).__name__
                raise OffloadPlanError(
                    f"offload plan of {type(self.dit).__name__} names on_demand path {path!r}, "
                    f"which is {kind}; expected a module that the forward calls"
                )
            found.append(OnDemandModule(path, module))
        return tuple(found)
