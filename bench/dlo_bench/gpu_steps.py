"""The CUDA step-time comparison of `dlo bench gpu-check`, on Flux-size blocks.

Owns building the model (Flux.1 widths, initialized on the GPU from a fixed seed, bfloat16), its
inputs, the timing of one step per variant, and the H2D peak of pinned memory. Called by
`dlo_bench.gpu_check` only on a machine with CUDA; must not be imported by the runtime.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dlo_bench.gpu_check import FLUX_WIDTHS


def _build(args: argparse.Namespace, device: torch.device) -> nn.Module:
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    with torch.device(device):
        model = FluxTransformer2DModel(
            num_layers=args.double, num_single_layers=args.single, **FLUX_WIDTHS)
    return nn.Module.to(model, torch.bfloat16).eval()


def _inputs(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    gen = torch.Generator(device).manual_seed(1)
    b, n, t = args.batch, args.image_tokens, args.text_tokens
    side = int(n ** 0.5)
    img_ids = torch.zeros(side, side, 3, device=device)
    img_ids[..., 1] = torch.arange(side, device=device)[:, None]
    img_ids[..., 2] = torch.arange(side, device=device)[None, :]

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.bfloat16)

    return {"hidden_states": rand(b, side * side, FLUX_WIDTHS["in_channels"]),
            "encoder_hidden_states": rand(b, t, FLUX_WIDTHS["joint_attention_dim"]),
            "pooled_projections": rand(b, FLUX_WIDTHS["pooled_projection_dim"]),
            "timestep": torch.full((b,), 0.5, device=device, dtype=torch.bfloat16),
            "img_ids": img_ids.reshape(-1, 3), "txt_ids": torch.zeros(t, 3, device=device),
            "return_dict": False}


def _timed(model: nn.Module, inputs: dict[str, Any], args: argparse.Namespace
           ) -> tuple[float, torch.Tensor]:
    """Median seconds of one step after the warm-up, and the last output."""
    def step() -> torch.Tensor:
        with torch.inference_mode():
            return model(**inputs)[0]

    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times), out


def h2d_peak_gbps(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Host-to-device GB/s of one pinned buffer (PyTorch's allocator), best of five."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return nbytes / best / 1e9


def _block_copy_gbps(backend: Any) -> float:
    """GB/s of DLO's own block transfers (copy stream, exact pinned arenas), one at a time."""
    seconds, nbytes = 0.0, 0
    for index, layout in enumerate(backend.layouts):
        slot = backend.slots[index % 2]
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record(backend._streams.copy)
        backend._scheduler.load(index, slot)
        end.record(backend._streams.copy)
        end.synchronize()
        seconds += start.elapsed_time(end) / 1e3
        nbytes += layout.nbytes // layout.shard_count
    return nbytes / seconds / 1e9


def _settings(dp: int = 1) -> Any:
    from dlo_contract.settings import OffloadConfig, ParallelConfig, Settings

    return Settings(offload=OffloadConfig(use_allgather=dp > 1), parallel=ParallelConfig(dp=dp))


def _dlo(model: nn.Module, inputs: dict[str, Any], args: argparse.Namespace,
         device: torch.device, group: Any = None, dp: int = 1) -> dict[str, Any]:
    from dlo_runtime.backend import DistributedLayerwiseOffloadBackend

    backend = DistributedLayerwiseOffloadBackend(
        model, settings=_settings(dp), device=device, group=group)
    with backend:
        seconds, out = _timed(model, inputs, args)
        stats = backend.stats().last_forward
        figures = {"step_s": seconds, "out": out, "blocks": len(backend.layouts),
                   "slot_wait_ms": stats.slot_wait_s * 1e3, "h2d_bytes": stats.bytes_h2d,
                   "gathered_bytes": stats.bytes_gathered,
                   "streamed_share": backend.streamed_share,
                   "copy_gbps": _block_copy_gbps(backend),
                   "host_pinned_bytes": backend._streams.host_memory.pinned_bytes}
    return figures


def rank_local(args: argparse.Namespace) -> dict[str, Any]:
    from diffusers.hooks import apply_group_offloading

    device = torch.device("cuda", 0)
    model = _build(args, device)
    inputs = _inputs(args, device)
    peak = h2d_peak_gbps(device)
    resident_s, expected = _timed(model, inputs, args)
    nn.Module.to(model, "cpu")
    torch.cuda.empty_cache()
    dlo = _dlo(model, inputs, args, device)
    torch.cuda.empty_cache()
    apply_group_offloading(model, onload_device=device, offload_device=torch.device("cpu"),
                           offload_type="block_level", num_blocks_per_group=1, use_stream=True)
    group_s, group_out = _timed(model, inputs, args)
    blocks = dlo["blocks"]
    return {
        "h2d_pinned_peak_gbps": peak,
        "resident_step_ms": resident_s * 1e3,
        "resident_ms_per_block": resident_s * 1e3 / blocks,
        "dlo_step_ms": dlo["step_s"] * 1e3,
        "group_offload_step_ms": group_s * 1e3,
        "dlo_vs_resident_ratio": dlo["step_s"] / resident_s,
        "dlo_vs_group_offload_ratio": dlo["step_s"] / group_s,
        "dlo_equal": torch.equal(dlo["out"], expected),
        "group_offload_matches_resident": torch.equal(group_out, expected),
        "dlo_block_copy_gbps": dlo["copy_gbps"],
        "dlo_copy_vs_peak_ratio": dlo["copy_gbps"] / peak,
        "dlo_copy_ms_per_block": dlo["h2d_bytes"] / blocks / (dlo["copy_gbps"] * 1e6),
        "dlo_slot_wait_ms_per_step": dlo["slot_wait_ms"],
        "dlo_h2d_bytes_per_step": dlo["h2d_bytes"],
        "dlo_streamed_share": dlo["streamed_share"],
        "dlo_host_pinned_bytes": dlo["host_pinned_bytes"],
    }


def allgather(args: argparse.Namespace, world: int = 2) -> dict[str, Any]:
    """DLO AllGather over `world` NCCL ranks (one GPU each) against each rank's resident step."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder, socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sock.close()
        mp.spawn(_allgather_rank, args=(world, port, args, folder), nprocs=world)
        return json.loads(Path(folder, "rank0.json").read_text())


def _allgather_rank(rank: int, world: int, port: int, args: argparse.Namespace,
                    folder: str) -> None:
    import torch.distributed as dist

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=device)
    try:
        model = _build(args, device)
        inputs = _inputs(args, device)
        resident_s, expected = _timed(model, inputs, args)
        nn.Module.to(model, "cpu")
        torch.cuda.empty_cache()
        dlo = _dlo(model, inputs, args, device, group=dist.group.WORLD, dp=world)
        figures = {
            "allgather_ranks": world,
            "allgather_resident_step_ms": resident_s * 1e3,
            "allgather_dlo_step_ms": dlo["step_s"] * 1e3,
            "allgather_dlo_vs_resident_ratio": dlo["step_s"] / resident_s,
            "allgather_dlo_equal": torch.equal(dlo["out"], expected),
            "allgather_slot_wait_ms_per_step": dlo["slot_wait_ms"],
            "allgather_gathered_bytes_per_step": dlo["gathered_bytes"],
        }
        if rank == 0:
            Path(folder, "rank0.json").write_text(json.dumps(figures))
    finally:
        dist.destroy_process_group()
