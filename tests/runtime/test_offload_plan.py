"""Module discovery and offload plans: built-in plans for the diffusers DiTs, a model's own
declaration (mapping, plan object or method), the heuristic, and the errors that name the fix."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from runtime_models import DeclaredDiT, MlpBlock, UndeclaredDiT, seeded
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
                     "with 'blocks' (and optionally 'resident')"),
        ({"blocks": ["layers"], "skip": []},
         "Bad._dlo_offload_plan: unknown key(s) skip; allowed: blocks, resident"),
        ({"blocks": "layers"},
         "Bad._dlo_offload_plan['blocks'] must be a list of dotted module paths, "
         "found 'layers'"),
        ({"blocks": []},
         "offload plan: blocks is empty; name at least one nn.ModuleList of DiT blocks"),
        ({"blocks": ["layers"], "resident": ["adapters"]},
         "offload plan: resident path(s) adapters are not block lists; allowed: layers"),
    ],
)
def test_malformed_declarations(declared: object, message: str) -> None:
    bad = type("Bad", (UndeclaredDiT,), {"_dlo_offload_plan": declared})
    with pytest.raises(OffloadPlanError) as caught:
        plan_for(bad())
    assert str(caught.value) == message


def test_something_that_is_no_dit() -> None:
    with pytest.raises(OffloadPlanError) as caught:
        ModuleDiscovery(SimpleNamespace(unet=None))
    assert str(caught.value) == (
        "cannot find a DiT in SimpleNamespace: expected an nn.Module or a pipeline with a "
        "`transformer` module"
    )
