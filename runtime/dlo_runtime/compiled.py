"""How DLO meets `torch.compile`: its hooks stay outside the compiled graphs.

Owns the decorator that the per-block, on-demand and forward-gate hooks wear, and the unwrapping
of a module that `torch.compile(module)` wrapped. Called by `dlo_runtime.hooks`,
`dlo_runtime.on_demand`, `dlo_runtime.forward_gate` and `dlo_runtime.discovery`; it must not
compile anything itself or change dynamo's configuration.

[Note: compiled graphs] A streamed block's weights change storage on every call: its pre-hook
points them into a device slot, its post-hook back at an empty placeholder. Dynamo cannot trace
that (a `.data` assignment traced into a graph keeps the shapes seen at trace time), so every
DLO hook is `torch.compiler.disable`d and always runs eagerly, in program order, with its
stream waits and event records exactly as without compilation:
- Regional (`compile_repeated_blocks()`, a block's `compile()`, or its `forward` compiled):
  dynamo does not trace the frame of `nn.Module._call_impl`, where the hooks are called; it
  starts at the block's `forward`. The hooks run around the block's compiled frame, which sees
  the slot views and stays one graph (`fullgraph=True` works).
- Whole model (`module.compile()`, `torch.compile(module)`): the DiT's forward inlines each block
  call with its hooks, and dynamo breaks the graph at each hook, runs it eagerly and resumes
  after it. `fullgraph=True` refuses such a break; dynamo's error then carries `HOOK_REASON`.
No recompilation follows per step: the graphs take parameters as inputs (PyTorch's default
`inline_inbuilt_nn_modules`), and a block's views have the same shapes, strides and dtypes in
either slot. A graph traced before `enable` reads the weights only after the pre-hook has
pointed them into a slot, with the shapes it was traced with, so compiling and running before
enabling is safe too (a whole-model graph recompiles once: its guards see the placeholders).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

F = TypeVar("F", bound=Callable[..., object])

HOOK_REASON = (
    "dlo: a streamed block's weights are repointed into a device slot by eager forward hooks, "
    "at which a whole-model graph must break; fullgraph=True refuses that. Compile the blocks "
    "instead (transformer.compile_repeated_blocks(fullgraph=True), or each streamed block's "
    "compile(fullgraph=True)), or compile the whole model without fullgraph=True"
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
