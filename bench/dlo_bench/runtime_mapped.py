"""`dlo bench runtime`'s mapped-checkpoint figures: a rank-local DiT on the CPU backed by a
checkpoint entry, against the resident model in the same run.

Owns the three checkpoint layouts a server may map: every tensor on the 64-byte boundary a fresh
allocation has (used in place, zero-copy), every tensor 8 bytes off it, and the layout diffusers'
`save_pretrained` writes, which is what published checkpoints look like (tensors 8-byte aligned
only, so most lie off the boundary). Views off the boundary are copied into the slots at each
load ([Note: compute alignment] in `dlo_runtime.transfer`); this measures what that costs. Steps
are interleaved, resident and each layout in turn, so machine noise falls on all alike. Called
by `dlo_bench.runtime`; must not be imported by the runtime.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

LAYOUTS = ("aligned", "skewed", "diffusers")


def cpu_mapped(args: argparse.Namespace) -> dict[str, Any]:
    """Per layout: the step ratio to resident, the share of streamed bytes copied per step and
    whether the output equals the resident one bit for bit."""
    import torch

    from dlo_bench.models import example_inputs, tiny_model
    from dlo_runtime.offload_plan import weight_bytes

    model = tiny_model(args.kind, num_layers=args.layers, head_dim=args.head_dim)
    inputs = example_inputs(args.kind, model, batch=args.batch, side=args.side)

    def stepper(dit: Any) -> Callable[[], torch.Tensor]:
        def step() -> torch.Tensor:
            with torch.inference_mode():
                return dit(**inputs)[0]
        return step

    expected = stepper(model)()
    total_bytes = weight_bytes(model)
    with tempfile.TemporaryDirectory() as work:
        handles = {layout: _enable(model, Path(work) / layout, layout) for layout in LAYOUTS}
        try:
            steps = {"resident": stepper(model)}
            steps |= {layout: stepper(dit) for layout, (dit, _) in handles.items()}
            equal = {layout: torch.equal(steps[layout](), expected) for layout in LAYOUTS}
            times = _interleaved(steps, args)
            figures: dict[str, Any] = {"cpu_mapped_resident_step_us": times["resident"] * 1e6}
            for layout, (_, handle) in handles.items():
                stats = handle.stats().last_forward
                streamed = handle.streamed_share * total_bytes
                figures |= {
                    f"cpu_mapped_{layout}_equal": equal[layout],
                    f"cpu_mapped_{layout}_step_ratio": times[layout] / times["resident"],
                    f"cpu_mapped_{layout}_copied_share": stats.bytes_h2d / streamed,
                }
        finally:
            for _, handle in handles.values():
                handle.close()
    return figures


def _enable(model: Any, work: Path, layout: str) -> tuple[Any, Any]:
    """Publish `model` in `layout` as a checkpoint entry and enable a weightless DiT over it."""
    from dlo_bench.entries import publish_layout, rank_local_settings
    from dlo_bench.models import save_diffusers_layout, save_skewed_layout
    from dlo_runtime import pod

    if layout == "diffusers":
        save_diffusers_layout(model, work / "layout")
    else:
        save_skewed_layout(model, work / "layout", 0 if layout == "aligned" else 8)
    entry = publish_layout(work / "cache", work / "layout", f"file://bench/{layout}", link=True)
    (work / "entry.json").write_text(entry.to_json())
    settings = rank_local_settings(work / "cache")
    dit = pod.build_dit(type(model), settings=settings, entry_file=str(work / "entry.json"))
    handle = pod.enable(dit, device="cpu", settings=settings,
                        entry_file=str(work / "entry.json"))
    return dit, handle


def _interleaved(steps: dict[str, Callable[[], Any]], args: argparse.Namespace
                 ) -> dict[str, float]:
    """Median seconds of one step of each, after `args.warmup` untimed rounds, the variants
    taking turns step by step."""
    for _ in range(args.warmup):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.steps):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(spent) for name, spent in times.items()}
