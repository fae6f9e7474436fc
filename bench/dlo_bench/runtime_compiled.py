"""`dlo bench runtime --compiled`: step time under `torch.compile`, DLO against resident.

Owns the compiled column of the runtime benchmark. On the CPU it times four variants of one
model in the same run: resident and DLO (rank-local), each eager and compiled the same way
(`--compile-mode regional`: diffusers' `compile_repeated_blocks()`; `whole`: `module.compile()`),
with DLO enabled before compiling. On CUDA, `cuda_compiled` times compiled resident, compiled DLO
and compiled diffusers group offloading (block level, streams). Every compiled output is compared
bit for bit with the compiled resident one (same compile settings) before a figure is reported,
and every variant starts from a fresh dynamo state so that no variant reuses another's graphs.
Called by `dlo_bench.runtime`; must not be imported by the runtime.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


def _compile(model: Any, mode: str) -> None:
    """Regional: `compile_repeated_blocks()`, or each block's `compile()` for a class without
    `_repeated_blocks` (SD3 in this diffusers release); whole: `module.compile()`."""
    from dlo_runtime.discovery import ModuleDiscovery

    if mode == "whole":
        model.compile()
    elif getattr(model, "_repeated_blocks", None):
        model.compile_repeated_blocks()
    else:
        for block in ModuleDiscovery(model).discover().streamed:
            block.module.compile()


def cpu_compiled(
    args: argparse.Namespace, timed: Callable[..., float], settings: Any
) -> dict[str, Any]:
    """Eager and compiled step times, resident and DLO, on the CPU; ratios between them."""
    import torch

    from dlo_bench.models import example_inputs, tiny_model
    from dlo_runtime.backend import DistributedLayerwiseOffloadBackend

    def build() -> Any:
        return tiny_model(args.kind, num_layers=args.layers, head_dim=args.head_dim)

    inputs = example_inputs(args.kind, build(), batch=args.batch, side=args.side)

    def measure(model: Any) -> tuple[float, torch.Tensor]:
        def step() -> torch.Tensor:
            with torch.inference_mode():
                return model(**inputs)[0]

        first = step()  # the compiling forward, untimed
        return timed(step, args, lambda: None), first

    seconds: dict[str, float] = {}
    outputs: dict[str, torch.Tensor] = {}
    for name, offload, compiled in (
        ("resident", False, False), ("dlo", True, False),
        ("compiled_resident", False, True), ("compiled_dlo", True, True),
    ):
        torch._dynamo.reset()
        model = build()
        backend = DistributedLayerwiseOffloadBackend(model, settings=settings, device="cpu")
        if offload:
            backend.enable()
        if compiled:
            _compile(model, args.compile_mode)
        seconds[name], outputs[name] = measure(model)
        if offload:
            backend.disable()
    torch._dynamo.reset()
    return {
        "cpu_compiled_dlo_equal": torch.equal(outputs["compiled_dlo"], outputs["compiled_resident"]),
        "cpu_compiled_resident_step_us": seconds["compiled_resident"] * 1e6,
        "cpu_compiled_dlo_step_us": seconds["compiled_dlo"] * 1e6,
        "cpu_compiled_vs_eager_resident_ratio": seconds["compiled_resident"] / seconds["resident"],
        "cpu_compiled_vs_eager_dlo_ratio": seconds["compiled_dlo"] / seconds["dlo"],
        "cpu_compiled_dlo_vs_compiled_resident_ratio": (
            seconds["compiled_dlo"] / seconds["compiled_resident"]
        ),
    }


def cuda_compiled(
    args: argparse.Namespace, timed: Callable[..., float], settings: Any
) -> dict[str, Any]:
    """Compiled step times on CUDA: resident, DLO and diffusers group offloading."""
    import torch
    from diffusers.hooks import apply_group_offloading

    from dlo_bench.models import example_inputs, tiny_model
    from dlo_runtime.backend import DistributedLayerwiseOffloadBackend

    device = torch.device("cuda")

    def build() -> Any:
        return tiny_model(args.kind, num_layers=args.layers, head_dim=args.cuda_head_dim,
                          dtype=torch.bfloat16)

    def measure(model: Any) -> tuple[float, Any]:
        inputs = example_inputs(args.kind, model, batch=args.batch, side=args.cuda_side)
        inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in inputs.items()}

        def step() -> Any:
            with torch.inference_mode():
                return model(**inputs)[0]

        first = step()  # the compiling forward, untimed
        return timed(step, args, torch.cuda.synchronize), first

    torch._dynamo.reset()
    resident = build().to(device)
    _compile(resident, args.compile_mode)
    resident_s, expected = measure(resident)
    del resident
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    dlo_model = build()
    with DistributedLayerwiseOffloadBackend(dlo_model, settings=settings, device=device):
        _compile(dlo_model, args.compile_mode)
        dlo_s, dlo_out = measure(dlo_model)
    del dlo_model
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    group_model = build()
    apply_group_offloading(group_model, onload_device=device, offload_type="block_level",
                           num_blocks_per_group=1, use_stream=True)
    _compile(group_model, args.compile_mode)
    group_s, group_out = measure(group_model)
    torch._dynamo.reset()
    return {
        "cuda_compiled_dlo_equal": torch.equal(dlo_out, expected),
        "cuda_compiled_group_offload_matches_resident": torch.equal(group_out, expected),
        "cuda_compiled_resident_step_ms": resident_s * 1e3,
        "cuda_compiled_dlo_step_ms": dlo_s * 1e3,
        "cuda_compiled_group_offload_step_ms": group_s * 1e3,
        "cuda_compiled_dlo_vs_resident_ratio": dlo_s / resident_s,
        "cuda_compiled_dlo_vs_group_offload_ratio": dlo_s / group_s,
    }
