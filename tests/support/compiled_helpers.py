"""Shared by the torch.compile tests and their gloo workers: the ways a user compiles a DiT, and
one compiled DLO run against the compiled resident model with the figures the tests check."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from support.runtime_models import DeclaredDiT, seeded
from torch import nn
from torch._dynamo.utils import counters

from dlo_bench.models import example_inputs, tiny_model
from dlo_contract.settings import Settings
from dlo_runtime.backend import DistributedLayerwiseOffloadBackend
from dlo_runtime.discovery import ModuleDiscovery

Compile = Callable[[nn.Module], Callable[..., Any]]


def regional(model: nn.Module) -> nn.Module:
    """diffusers' regional compilation, or each block's own `compile()` for a DiT without
    `_repeated_blocks` (the two-stack DiT)."""
    if getattr(model, "_repeated_blocks", None):
        model.compile_repeated_blocks()
    else:
        for block in _blocks(model):
            block.compile()
    return model


def _blocks(model: nn.Module) -> list[nn.Module]:
    """Every block of the model's offload plan, in execution order."""
    return [block.module for block in ModuleDiscovery(model).discover().streamed]


def whole(model: nn.Module) -> nn.Module:
    model.compile()
    return model


def wrapped(model: nn.Module) -> nn.Module:
    return torch.compile(model)


def forwards(model: nn.Module) -> nn.Module:
    """Each streamed block's `forward` compiled with `fullgraph=True`: the DLO hooks stay outside
    the compiled regions and every block is one graph."""
    for block in _blocks(model):
        block.forward = torch.compile(block.forward, fullgraph=True)
    return model


def regional_fullgraph(model: nn.Module) -> nn.Module:
    """Each streamed block's `compile(fullgraph=True)`: the hooks run outside its frame."""
    for block in _blocks(model):
        block.compile(fullgraph=True)
    return model


COMPILES: dict[str, Compile] = {
    "regional": regional, "whole": whole, "wrapped": wrapped, "forwards": forwards,
    "regional-fullgraph": regional_fullgraph,
}


def build(kind: str, seed: int = 0) -> tuple[nn.Module, dict[str, Any]]:
    """A tiny seeded DiT of `kind` (a diffusers class, or `two-stack`) and its inputs."""
    if kind == "two-stack":
        model = seeded(DeclaredDiT, seed)
        x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(seed))
        return model, {"x": x}
    model = tiny_model(kind, seed=seed, num_layers=2)  # type: ignore[arg-type]
    return model, example_inputs(kind, model, seed=seed)  # type: ignore[arg-type]


def output(model: Callable[..., Any], inputs: dict[str, Any]) -> torch.Tensor:
    with torch.no_grad():
        result = model(**inputs)
    return result if isinstance(result, torch.Tensor) else result[0]


def graphs() -> int:
    """Graphs dynamo has compiled in this process so far (a recompile adds one)."""
    return counters["stats"]["unique_graphs"]


@dataclass
class CompiledOutcome:
    """What one compiled DLO run showed, in plain values so that worker processes can send it."""

    equal_warmup: bool
    """The first (compiling) offloaded forward equals the compiled resident one bit for bit."""
    equal_steady: bool
    """Two more forwards do too."""
    steady_graphs: int
    """Graphs compiled during those two forwards (run under `error_on_recompile`): 0."""
    warmup_graphs: int
    """Graphs compiled by the warm-up forward."""
    equal_after_disable: bool
    """The compiled model, DLO disabled, still equals the compiled resident one."""
    mode: str


def compiled_case(
    kind: str,
    settings: Settings,
    compile_model: Compile,
    *,
    group: dist.ProcessGroup | None = None,
    order: str = "enable-first",
) -> CompiledOutcome:
    """Compiled resident forward, then compiled DLO forwards of the same seeded weights, DLO
    enabled before compiling (`enable-first`), after compiling (`compile-first`: the backend is
    given what compiling returned), or after a compiled resident forward of the same model
    (`run-first`, whose output is then the reference)."""
    torch._dynamo.reset()
    model, inputs = build(kind)
    if order == "run-first":
        compiled = compile_model(model)
        expected = output(compiled, inputs)
        backend = DistributedLayerwiseOffloadBackend(
            compiled, settings=settings, device="cpu", group=group
        ).enable()
    else:
        reference, _ = build(kind)
        expected = output(compile_model(reference), inputs)
        # A fresh start, as in a serving process: dynamo's caches are per code object, so the
        # resident model's entries would otherwise be tried for the DLO model.
        torch._dynamo.reset()
        if order == "enable-first":
            backend = DistributedLayerwiseOffloadBackend(
                model, settings=settings, device="cpu", group=group
            ).enable()
            compiled = compile_model(model)
        else:
            compiled = compile_model(model)
            backend = DistributedLayerwiseOffloadBackend(
                compiled, settings=settings, device="cpu", group=group
            ).enable()
    before = graphs()

    first = output(compiled, inputs)
    warm = graphs()
    with torch._dynamo.config.patch(error_on_recompile=True):
        steady = [output(compiled, inputs) for _ in range(2)]
    steady_graphs = graphs() - warm
    mode = backend.mode
    backend.disable()
    after = output(compiled, inputs)
    torch._dynamo.reset()
    return CompiledOutcome(
        equal_warmup=torch.equal(first, expected),
        equal_steady=all(torch.equal(out, expected) for out in steady),
        steady_graphs=steady_graphs,
        warmup_graphs=warm - before,
        equal_after_disable=torch.equal(after, expected),
        mode=mode,
    )
