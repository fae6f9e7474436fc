"""Module discovery and offload plans: built-in plans for the diffusers DiTs, a model's own
declaration (mapping, plan object or method), the heuristic, and the errors that name the fix."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from support.runtime_models import DeclaredDiT, MlpBlock, OnDemandDiT, UndeclaredDiT, seeded
from torch import nn

from dlo_bench.models import tiny_model
from dlo_runtime.discovery import ModuleDiscovery
from dlo_runtime.offload_plan import OffloadPlan, OffloadPlanError, plan_for


@pytest.mark.parametrize(
    ("kind", "lists", "count"),
    [
        ("flux", ("transformer_blocks", "single_transformer_blocks"), 5),
        ("sd3", ("transformer_blocks",), 4),
        ("wan", ("blocks",), 3),
    ],
)
def test_builtin_plans_for_diffusers_dits(kind: str, lists: tuple[str, ...], count: int) -> None:
    model = tiny_model(kind)
    plan = plan_for(model)
    assert (plan.blocks, plan.source) == (lists, "builtin")
    discovered = ModuleDiscovery(SimpleNamespace(transformer=model)).discover()
    assert discovered.dit is model
    assert len(discovered.streamed) == count
    assert [b.index for b in discovered.streamed] == list(range(count))


def test_flux_blocks_run_double_stream_first() -> None:
    discovered = ModuleDiscovery(tiny_model("flux")).discover(resident_layers=1)
    assert [b.path for b in discovered.resident] == ["transformer_blocks.0"]
    assert [b.path for b in discovered.streamed] == [
        "transformer_blocks.1", "single_transformer_blocks.0", "single_transformer_blocks.1",
        "single_transformer_blocks.2",
    ]


def test_a_declared_mapping_wins() -> None:
    plan = plan_for(seeded(DeclaredDiT))
    assert plan == OffloadPlan(blocks=("stem", "head"), resident=("stem",), source="declared")


def test_a_declared_method_returning_a_plan() -> None:
    class MethodDiT(UndeclaredDiT):
        def _dlo_offload_plan(self) -> OffloadPlan:
            return OffloadPlan(blocks=("adapters", "layers"))

    discovered = ModuleDiscovery(MethodDiT()).discover()
    assert [b.path for b in discovered.streamed] == [
        "adapters.0", "adapters.1", "layers.0", "layers.1", "layers.2",
    ]


def test_the_heuristic_takes_the_largest_list_of_one_block_class() -> None:
    assert plan_for(UndeclaredDiT()) == OffloadPlan(blocks=("layers",), source="heuristic")


def test_no_block_list_names_the_declaration_to_add() -> None:
    with pytest.raises(OffloadPlanError) as caught:
        plan_for(nn.Sequential(nn.Linear(2, 2), MlpBlock(2, 4)))
    assert str(caught.value) == (
        "Sequential has no nn.ModuleList of two or more blocks of one class; declare the "
        "block lists with a class attribute _dlo_offload_plan = {'blocks': ['<path>', ...]}"
    )


def test_a_plan_naming_a_missing_list() -> None:
    class Wrong(UndeclaredDiT):
        _dlo_offload_plan = {"blocks": ["layers", "decoder"]}

    with pytest.raises(OffloadPlanError) as caught:
        ModuleDiscovery(Wrong()).discover()
    assert str(caught.value) == (
        "offload plan of Wrong names 'decoder', which is nothing; expected an nn.ModuleList "
        "of blocks"
    )


def test_a_plan_listing_a_block_twice() -> None:
    class Twice(UndeclaredDiT):
        _dlo_offload_plan = {"blocks": ["layers", "layers"]}

    with pytest.raises(OffloadPlanError) as caught:
        ModuleDiscovery(Twice()).discover()
    assert str(caught.value) == (
        "offload plan of Twice: block layers.0 appears twice; each block may be listed once"
    )


@pytest.mark.parametrize(
    ("declared", "message"),
    [
        (["layers"], "Bad._dlo_offload_plan is a list; expected an OffloadPlan or a mapping "
                     "with 'blocks' (and optionally 'resident', 'on_demand')"),
        ({"blocks": ["layers"], "skip": []},
         "Bad._dlo_offload_plan: unknown key(s) skip; allowed: blocks, resident, on_demand"),
        ({"blocks": "layers"},
         "Bad._dlo_offload_plan['blocks'] must be a list of dotted module paths, "
         "found 'layers'"),
        ({"blocks": []},
         "offload plan: blocks is empty; name at least one nn.ModuleList of DiT blocks"),
        ({"blocks": ["layers"], "resident": ["adapters"]},
         "offload plan: resident path(s) adapters are not block lists; allowed: layers"),
        ({"blocks": ["layers"], "on_demand": "mixed"},
         "Bad._dlo_offload_plan['on_demand'] must be a list of dotted module paths, "
         "found 'mixed'"),
        ({"blocks": ["layers"], "on_demand": ["layers.1"]},
         "offload plan: on_demand path 'layers.1' overlaps block list 'layers'; name modules "
         "outside the block lists"),
        ({"blocks": ["layers.0.up", "adapters"], "on_demand": ["layers"]},
         "offload plan: on_demand path 'layers' overlaps block list 'layers.0.up'; name "
         "modules outside the block lists"),
        ({"blocks": ["layers"], "on_demand": [""]},
         "offload plan: on_demand path '' overlaps block list 'layers'; name modules outside "
         "the block lists"),
        ({"blocks": ["layers"], "on_demand": ["mixed", "adapters", "mixed.1.gate"]},
         "offload plan: on_demand paths 'mixed' and 'mixed.1.gate' overlap; name each module "
         "once, and no module inside another"),
        ({"blocks": ["layers"], "on_demand": ["adapters.0", "adapters.0"]},
         "offload plan: on_demand paths 'adapters.0' and 'adapters.0' overlap; name each "
         "module once, and no module inside another"),
    ],
)
def test_malformed_declarations(declared: object, message: str) -> None:
    bad = type("Bad", (UndeclaredDiT,), {"_dlo_offload_plan": declared})
    with pytest.raises(OffloadPlanError) as caught:
        plan_for(bad())
    assert str(caught.value) == message


def test_a_declared_mapping_with_on_demand_modules() -> None:
    discovered = ModuleDiscovery(seeded(OnDemandDiT)).discover()
    assert discovered.plan == OffloadPlan(
        blocks=("layers",), on_demand=("embed", "refiner"), source="declared"
    )
    assert [(m.path, m.module) for m in discovered.on_demand] == [
        ("embed", discovered.dit.embed), ("refiner", discovered.dit.refiner),
    ]
    assert [b.path for b in discovered.streamed] == ["layers.0", "layers.1", "layers.2"]


@pytest.mark.parametrize(
    ("on_demand", "message"),
    [
        ("decoder", "offload plan of Bad names on_demand path 'decoder', which is nothing; "
                    "expected a module that the forward calls"),
        ("adapters", "offload plan of Bad names on_demand path 'adapters', which is ModuleList; "
                     "expected a module that the forward calls"),
    ],
)
def test_on_demand_paths_must_name_modules_the_forward_calls(on_demand: str, message: str) -> None:
    bad = type("Bad", (UndeclaredDiT,), {
        "_dlo_offload_plan": {"blocks": ["layers"], "on_demand": ["mixed.1", on_demand]},
    })
    with pytest.raises(OffloadPlanError) as caught:
        ModuleDiscovery(bad()).discover()
    assert str(caught.value) == message


def test_something_that_is_no_dit() -> None:
    with pytest.raises(OffloadPlanError) as caught:
        ModuleDiscovery(SimpleNamespace(unet=None))
    assert str(caught.value) == (
        "cannot find a DiT in SimpleNamespace: expected an nn.Module or a pipeline with one of "
        "the attributes transformer, transformer_2"
    )


def test_a_pipeline_with_two_dits_names_both_for_one_backend() -> None:
    pipeline = SimpleNamespace(transformer=UndeclaredDiT(), transformer_2=UndeclaredDiT())
    with pytest.raises(OffloadPlanError) as caught:
        ModuleDiscovery(pipeline)
    assert str(caught.value) == (
        "SimpleNamespace has 2 DiTs (transformer, transformer_2): a backend offloads one"
    )
    assert caught.value.hint == (
        "pass each DiT to its own backend, or use dlo_runtime.pod.enable(pipeline)"
    )
