"""One data-parallel rank of `dlo demo`, offloaded or resident, in a process of its own.

Run by `dlo_bench.demo` as `python -m dlo_bench.demo_runtime --mode offloaded|resident --rank R
[--world-size W --port P] --steps N --work DIR`, with `DLO_CONFIG` and `DLO_ENTRY_FILE` set as in
a pod (contract C3). Offloaded: join a gloo world on 127.0.0.1 and build the DiT through the
in-pod entry point (`pod.build_dit`, `pod.enable`) from the loader's mapped entry. Resident: load
the same files ordinarily. Either way run an Euler loop over fixed inputs (`DIR/inputs<R>.pt`,
written by the parent). The two modes run in separate processes so that each one's PSS and step
times start from the same state. Writes the final latents to `DIR/<mode><R>.pt` and the figures
(backing, PSS, step times) to `DIR/<mode><R>.json`. It does not judge the outputs: the parent
compares them, so that one place decides what "identical" means.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from diffusers import FluxTransformer2DModel
from torch import nn

from dlo_bench.demo_report import MODES
from dlo_contract.names import ENTRY_FILE_ENV
from dlo_runtime import pod

_COLLECTIVE_TIMEOUT = timedelta(seconds=120)


def denoise(model: nn.Module, inputs: dict[str, Any],
            steps: int) -> tuple[torch.Tensor, list[float]]:
    """Flow-matching Euler steps from sigma 1 to 0: x <- x + (sigma_next - sigma) * v(x, sigma).

    Returns the final latents and the seconds each step took.
    """
    latents = inputs["hidden_states"]
    batch = latents.shape[0]
    sigmas = torch.linspace(1.0, 0.0, steps + 1, dtype=latents.dtype)
    seconds = []
    with torch.no_grad():
        for sigma, following in zip(sigmas[:-1], sigmas[1:], strict=True):
            start = time.perf_counter()
            velocity = model(**{**inputs, "hidden_states": latents,
                                "timestep": sigma.expand(batch)})[0]
            latents = latents + (following - sigma) * velocity
            seconds.append(time.perf_counter() - start)
    return latents, seconds


def pss_bytes() -> int:
    """Proportional set size of this process: each shared page is split among its sharers."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/smaps_rollup has no Pss line")


def _release_freed_memory() -> None:
    """Collect garbage and hand freed heap pages back to the kernel, so PSS shows what is live."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _offloaded(inputs: dict[str, Any], steps: int) -> tuple[torch.Tensor, dict[str, Any]]:
    """The run a serving pod does: a weightless DiT backed by the mapped entry, AllGather."""
    dit = pod.build_dit(FluxTransformer2DModel)
    weightless = all(p.is_meta for p in dit.parameters())
    handle = pod.enable(dit, device="cpu")
    try:
        latents, seconds = denoise(dit, inputs, steps)
        _release_freed_memory()
        figures = {"weightless": weightless, "backing": handle.backing().value,
                   "pss_bytes": pss_bytes(), "step_s": seconds}
    finally:
        handle.close()
    return latents, figures


def _resident(inputs: dict[str, Any], steps: int) -> tuple[torch.Tensor, dict[str, Any]]:
    """The baseline: the same files loaded ordinarily, every weight resident.

    diffusers leaves each loaded parameter a view at its offset in the safetensors file, which
    is rarely 64-byte aligned, and CPU GEMM kernels round differently for unaligned operands.
    Each parameter is moved into a fresh (aligned) allocation, as the offloaded DiT's slot
    buffers are, so that a bit-for-bit comparison compares the weights, not their alignment.
    """
    entry = pod.read_entry_file()
    if entry is None:
        raise RuntimeError(f"no entry file: {ENTRY_FILE_ENV} must name the loader's entry document")
    model = FluxTransformer2DModel.from_pretrained(entry.path / "transformer",
                                                   low_cpu_mem_usage=False).eval()
    for tensor in [*model.parameters(), *model.buffers()]:
        tensor.data = tensor.data.clone()
    _release_freed_memory()
    latents, seconds = denoise(model, inputs, steps)
    _release_freed_memory()
    return latents, {"pss_bytes": pss_bytes(), "step_s": seconds}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dlo_bench.demo_runtime")
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, help="gloo world size (offloaded mode)")
    parser.add_argument("--port", type=int, help="rank 0's gloo port on 127.0.0.1 (offloaded mode)")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--work", type=Path, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # one core per rank: ranks share the machine's cores
    inputs = torch.load(args.work / f"inputs{args.rank}.pt")
    start = pss_bytes()
    if args.mode == "offloaded":
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}",
                                rank=args.rank, world_size=args.world_size,
                                timeout=_COLLECTIVE_TIMEOUT)
        try:
            latents, figures = _offloaded(inputs, args.steps)
        finally:
            dist.destroy_process_group()
    else:
        latents, figures = _resident(inputs, args.steps)
    name = f"{args.mode}{args.rank}"
    torch.save(latents, args.work / f"{name}.pt")
    result = {"rank": args.rank, "mode": args.mode, "pss_start_bytes": start, **figures}
    (args.work / f"{name}.json").write_text(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
