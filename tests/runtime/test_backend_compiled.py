"""DLO under torch.compile (inductor, on the CPU): regional and whole-model compilation, DLO
enabled before or after compiling, give outputs equal bit for bit to the compiled resident model,
and after the warm-up forward further forwards compile nothing (`error_on_recompile`). AllGather
mode over gloo ranks is in `test_backend_compiled_distributed.py`.

Compiling costs CPU: the models are the smallest that keep their block structure, and every
case shares one warm-up between its assertions. All but the two cheapest cases are marked slow."""

from __future__ import annotations

import pytest
import torch
from support.compiled_helpers import COMPILES, CompiledOutcome, build, compiled_case, output
from support.runtime_helpers import RANK_LOCAL

from dlo_runtime.backend import DistributedLayerwiseOffloadBackend
from dlo_runtime.compiled import HOOK_REASON
from dlo_runtime.discovery import ModuleDiscovery, find_dits


def _assert_exact_without_recompiles(outcome: CompiledOutcome, *, compiles: bool = True) -> None:
    """`compiles`: the warm-up forward is the one that compiles (not a resident one before)."""
    assert (outcome.equal_warmup, outcome.equal_steady, outcome.equal_after_disable) == (
        True, True, True,
    )
    assert (outcome.warmup_graphs > 0) is compiles
    assert outcome.steady_graphs == 0
    assert outcome.mode == "rank-local"


@pytest.mark.parametrize("kind", [pytest.param("flux", marks=pytest.mark.slow), "two-stack"])
def test_regional_compilation_after_enable(kind: str) -> None:
    """`compile_repeated_blocks()` (the two-stack DiT: each streamed block's `compile()`).

    Either way each streamed block's own `compile()` runs (diffusers' `compile_repeated_blocks`
    calls it on every block of a `_repeated_blocks` class), and DLO's hooks stay outside each
    compiled block frame. Flux brings a diffusers block of each kind (two classes, tuple outputs,
    rotary inputs); the two-stack DiT blocks of one class reused across slots, blocks of one class
    at three widths and a float64 buffer. SD3 and Wan would run the same path over blocks of the
    same kinds again, each paying a cold inductor compile of its own."""
    _assert_exact_without_recompiles(compiled_case(kind, RANK_LOCAL, COMPILES["regional"]))


@pytest.mark.parametrize(
    ("kind", "how", "order"),
    [
        pytest.param("flux", "whole", "enable-first", marks=pytest.mark.slow),
        pytest.param("flux", "wrapped", "compile-first", marks=pytest.mark.slow),
        pytest.param("flux", "regional", "run-first", marks=pytest.mark.slow),
        pytest.param("two-stack", "whole", "run-first", marks=pytest.mark.slow),
        pytest.param("two-stack", "wrapped", "compile-first", marks=pytest.mark.slow),
    ],
)
def test_whole_model_compilation_and_either_order(kind: str, how: str, order: str) -> None:
    """`module.compile()` / `torch.compile(module)` (the backend given the wrapper), DLO enabled
    before compiling, after, or after a compiled resident forward: a whole-model graph then
    recompiles once (its guards see placeholders), a block's graph is reused as it is (it runs
    after the pre-hook, on slot views of the shapes it was traced with)."""
    outcome = compiled_case(kind, RANK_LOCAL, COMPILES[how], order=order)
    _assert_exact_without_recompiles(outcome, compiles=(how, order) != ("regional", "run-first"))


@pytest.mark.slow
@pytest.mark.parametrize("how", ["regional-fullgraph", "forwards"])
def test_compiled_blocks_are_full_graphs(how: str) -> None:
    """`block.compile(fullgraph=True)`, or `block.forward = torch.compile(block.forward,
    fullgraph=True)`: the hooks run outside the block's compiled frame."""
    _assert_exact_without_recompiles(compiled_case("two-stack", RANK_LOCAL, COMPILES[how]))


def test_fullgraph_over_the_hooks_is_refused_with_the_way_out() -> None:
    torch._dynamo.reset()
    model, inputs = build("two-stack")
    with DistributedLayerwiseOffloadBackend(model, settings=RANK_LOCAL, device="cpu"):
        model.compile(fullgraph=True)
        with pytest.raises(torch._dynamo.exc.Unsupported) as caught:
            output(model, inputs)
    torch._dynamo.reset()
    assert HOOK_REASON in str(caught.value)


def test_a_dit_wrapped_by_torch_compile_is_offloaded_inside_the_wrapper() -> None:
    """`torch.compile(dit)` compiles lazily, so unwrapping costs nothing here."""
    model, _ = build("two-stack")

    class Pipeline:
        transformer = torch.compile(model)

    assert ModuleDiscovery(torch.compile(model)).dit is model
    assert ModuleDiscovery(Pipeline()).dit is model
    assert find_dits(Pipeline()) == [("transformer", model)]
    assert find_dits(torch.compile(model)) == [("transformer", model)]
