"""How DLO meets `torch.compile`: its hooks stay outside the compiled graphs.

Owns the decorator that the per-block and on-demand hooks wear, and the unwrapping of a module
that `torch.compile(module)` wrapped. Called by `dlo_runtime.hooks`, `dlo_runtime.on_demand` and
`dlo_runtime.discovery`; it must not compile anything itself or change dynamo's configuration.

[Note: compiled graphs] A streamed block's weights change storage on every call: its pre-hook
points them into a device slot, its post-hook back at an empty placeholder. Dynamo cannot trace
that (a `.data` assignment to a parameter inside a graph is baked into the graph with the shapes
seen at trace time), so every DLO hook is `torch.compiler.disable`d: where a compiled region
calls one (`module.compile()`, `torch.compile(module)` and diffusers' `compile_repeated_blocks`
all compile `nn.Module._call_impl`, hooks included), dynamo breaks the graph there, runs the hook
eagerly and resumes tracing after it, so the block's compiled graph sees the slot views, and the
acquire / prefetch / release bookkeeping, its stream waits and event records run eagerly in
program order exactly as without compilation. No recompilation follows per step: the graphs
take parameters as inputs (PyTorch's default `inline_inbuilt_nn_modules`), and a block's views
have the same shapes, strides and dtypes in either slot. Guards on the parameters' shapes also
make a graph traced before `enable` (full-size resident weights) fail once the weights are
placeholders, so compiling, running and then enabling recompiles once instead of running stale
code.

The one combination that cannot work is `fullgraph=True` on a region that contains a streamed
block's hooks (the whole model, or `compile_repeated_blocks(fullgraph=True)`), since a graph
break is refused there; dynamo's error then carries `HOOK_REASON`. Compiling the blocks'
`forward` instead (`block.forward = torch.compile(block.forward, fullgraph=True)`) keeps the
hooks outside the region and every block one graph.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

F = TypeVar("F", bound=Callable[..., object])

HOOK_REASON = (
    "dlo: a streamed block's weights are repointed into a device slot by eager forward hooks "
    "that compiled graphs call out to; fullgraph=True cannot compile a region that contains "
    "those hooks. Compile without fullgraph=True, or compile each streamed block's forward "
    "(block.forward = torch.compile(block.forward, fullgraph=True)) so that the hooks stay "
    "outside the compiled region"
)
"""Shown by dynamo where a graph cannot break at a DLO hook; see [Note: compiled graphs]."""


def outside_compiled_graphs(hook: F) -> F:
    """`hook` runs eagerly even when a compiled region calls it; see [Note: compiled graphs]."""
    return torch.compiler.disable(hook, reason=HOOK_REASON)  # type: ignore[no-any-return]


def uncompiled(module: nn.Module) -> nn.Module:
    """The module that `torch.compile(module)` wrapped (the module itself when not wrapped): its
    parameters, hooks and class are the ones DLO works on, and the wrapper calls into them."""
    while isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
        module = module._orig_mod
    return module
