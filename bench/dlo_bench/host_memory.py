"""`dlo bench runtime --host-memory`: host memory of P serving processes on one node, sharing one
cache entry versus each loading a private copy, and the cost of staging from a mapping.

Owns the benchmark, its worker processes and its report. Each of P real processes runs the same
DiT offloaded rank-local through `dlo_runtime.pod`: in `shared` mode backed by a checkpoint plan
over one published entry (weights built on the meta device, pages from the page cache), in
`private` mode loaded ordinarily with `from_pretrained`. The parent reads every process's
proportional set size (PSS, `/proc/<pid>/smaps_rollup`) while all of them are alive, once after
imports and once after the first forward, and reports the totals as ratios to the model's bytes.
It also times packing every block into a staging buffer from the mapped views against the same
packing from a private copy of the same bytes, in the same process. Outputs of all processes must
be equal before any figure is reported. Must not be imported by the runtime.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from dlo_bench import provenance
from dlo_contract.names import CONFIG_ENV, ENTRY_FILE_ENV

MODES = ("shared", "private")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--processes", type=int, default=4, help="serving processes per mode")
    parser.add_argument("--layers", type=int, default=16, help="Flux blocks (half double-stream)")
    parser.add_argument("--head-dim", type=int, default=256, help="Flux head width (2 heads)")
    parser.add_argument("--repeats", type=int, default=5, help="timed staging passes")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON line")


def run(args: argparse.Namespace) -> int:
    from diffusers import FluxTransformer2DModel

    from dlo_bench.models import save_diffusers_layout, tiny_model

    with tempfile.TemporaryDirectory(prefix="dlo-host-memory-") as scratch:
        work = Path(scratch)
        model = tiny_model("flux", num_layers=args.layers, head_dim=args.head_dim)
        model_bytes = sum(t.nbytes for t in model.state_dict().values())
        save_diffusers_layout(model, work / "layout")
        del model
        gc.collect()
        env = _pod_environment(work)
        modes = {mode: _measure_mode(mode, args.processes, env) for mode in MODES}
        outputs = {mode: figures.pop("outputs") for mode, figures in modes.items()}
        if not outputs_agree(outputs):
            print("host-memory: processes disagree on the forward output", file=sys.stderr)
            return 1
        staging = _staging_throughput(work, FluxTransformer2DModel, args.repeats, env)
    report = {
        "bench": "runtime-host-memory",
        "commit": provenance.commit(),
        "machine": provenance.machine(),
        "params": {"processes": args.processes, "layers": args.layers,
                   "head_dim": args.head_dim, "repeats": args.repeats},
        "model_bytes": model_bytes,
        **{mode: _ratios(figures, model_bytes) for mode, figures in modes.items()},
        "staging": staging,
    }
    _print(report, args.json)
    return 0


def outputs_agree(outputs: dict[str, list[str]]) -> bool:
    """The verdict: every process of every mode produced the same forward output (digest)."""
    return len({digest for digests in outputs.values() for digest in digests}) == 1


def _pod_environment(work: Path) -> dict[str, str]:
    """Publish the layout as a checkpoint entry and write the pod's settings and entry file."""
    from dlo_bench.entries import publish_layout, rank_local_settings

    entry = publish_layout(work / "cache", work / "layout", "file://bench/flux", link=True)
    (work / "entry.json").write_text(entry.to_json())
    (work / "settings.json").write_text(rank_local_settings(work / "cache").to_json())
    return {**os.environ, CONFIG_ENV: str(work / "settings.json"),
            ENTRY_FILE_ENV: str(work / "entry.json"), "OMP_NUM_THREADS": "1"}


def _measure_mode(mode: str, processes: int, env: dict[str, str]) -> dict[str, Any]:
    """Start P workers, measure total PSS after imports and after the first forward."""
    procs = [subprocess.Popen([sys.executable, "-m", "dlo_bench.host_memory", mode], env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for _ in range(processes)]
    try:
        _expect(procs, "imported")
        imported = _total_pss(procs)
        _send(procs)
        replies = _expect(procs, "ready")
        loaded = _total_pss(procs)
        _send(procs)
        for proc in procs:
            proc.wait(timeout=60)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            for pipe in (proc.stdin, proc.stdout):  # each worker's, not left to the collector
                if pipe is not None:
                    pipe.close()
    # The device slots live in host memory when the device is the CPU; in shared mode the two
    # staging slots are sized like them. Both are bounded by the largest block, not the model.
    slots = sum(int(reply[1]) for reply in replies) * (2 if mode == "shared" else 1)
    return {"imported_pss_bytes": imported["Pss"], "pss_bytes": loaded["Pss"],
            "anon_pss_bytes": loaded["Pss_Anon"], "file_pss_bytes": loaded["Pss_File"],
            "bounded_buffer_bytes": slots, "outputs": [reply[0] for reply in replies]}


def _expect(procs: list[subprocess.Popen[str]], word: str) -> list[list[str]]:
    replies = []
    for proc in procs:
        line = proc.stdout.readline().split()
        if not line or line[0] != word:
            raise RuntimeError(f"host-memory worker {proc.pid} failed before {word!r}")
        replies.append(line[1:])
    return replies


def _send(procs: list[subprocess.Popen[str]]) -> None:
    for proc in procs:
        proc.stdin.write("go\n")
        proc.stdin.flush()


def _total_pss(procs: list[subprocess.Popen[str]]) -> dict[str, int]:
    """Sum of `Pss`, `Pss_Anon` and `Pss_File` over the processes, in bytes."""
    totals = dict.fromkeys(("Pss", "Pss_Anon", "Pss_File"), 0)
    for proc in procs:
        with open(f"/proc/{proc.pid}/smaps_rollup") as rollup:
            for line in rollup:
                key, _, value = line.partition(":")
                if key in totals:
                    totals[key] += int(value.split()[0]) * 1024
    return totals


def _ratios(figures: dict[str, int], model_bytes: int) -> dict[str, float | int]:
    added = figures["pss_bytes"] - figures["imported_pss_bytes"]
    weights = added - figures["bounded_buffer_bytes"]
    return {**figures, "pss_ratio": round(figures["pss_bytes"] / model_bytes, 3),
            "added_pss_bytes": added, "added_ratio": round(added / model_bytes, 3),
            "weights_ratio": round(weights / model_bytes, 3)}


def _staging_throughput(work: Path, model_cls: Any, repeats: int,
                        env: dict[str, str]) -> dict[str, float]:
    """Pack every block into one staging buffer from the mapped views, and the same bytes from
    private memory: each warmed once, then the best of `repeats` interleaved passes."""
    import torch

    from dlo_runtime.checkpoint_plan import build_meta_dit, preflight
    from dlo_contract.settings import load_settings

    dit = build_meta_dit(model_cls, work / "layout" / "transformer", torch.float32)
    plan = preflight(work / "layout", dit, load_settings(env[CONFIG_ENV])).plan
    assert plan is not None, "the bench checkpoint must be accepted"
    mapped = plan.take_tensors()
    private = {name: view.clone() for name, view in mapped.items()}
    blocks = _blocks(mapped)
    staging = torch.empty(max(sum(mapped[n].nbytes for n in names) for names in blocks),
                          dtype=torch.uint8)
    total = sum(t.nbytes for names in blocks for t in (mapped[n] for n in names))
    sources = {"mapped": mapped, "memory": private}
    best = dict.fromkeys(sources, float("inf"))
    for label in sources:
        _pack(blocks, sources[label], staging)  # warm: fault the mapping in, touch the buffer
    for _ in range(repeats):
        # Interleaved, best of `repeats`: a busy neighbour slows one pass, not one side.
        for label in sources:
            start = time.perf_counter()
            _pack(blocks, sources[label], staging)
            best[label] = min(best[label], time.perf_counter() - start)
    rates = {label: total / seconds / 1e9 for label, seconds in best.items()}
    plan.close()
    return {"bytes_per_pass": total, "mapped_gbps": round(rates["mapped"], 2),
            "memory_gbps": round(rates["memory"], 2),
            "mapped_to_memory": round(rates["mapped"] / rates["memory"], 3)}


def _blocks(tensors: dict[str, Any]) -> list[list[str]]:
    """Tensor names grouped by DiT block (`<list>.<index>.`), in name order."""
    groups: dict[str, list[str]] = {}
    for name in sorted(tensors):
        parts = name.split(".")
        key = ".".join(parts[:2]) if len(parts) > 2 and parts[1].isdigit() else parts[0]
        groups.setdefault(key, []).append(name)
    return list(groups.values())


def _pack(blocks: list[list[str]], sources: dict[str, Any], staging: Any) -> None:
    import torch

    for names in blocks:
        offset = 0
        for name in names:
            flat = sources[name].reshape(-1).view(torch.uint8)
            staging[offset:offset + flat.numel()].copy_(flat)
            offset += flat.numel()




def _print(report: dict[str, Any], as_json: bool) -> None:
    for mode in MODES:
        figures = report[mode]
        print(f"{mode:>8}: total PSS {figures['pss_bytes'] / 2**20:8.1f} MiB = "
              f"{figures['pss_ratio']:.2f} x model; added by loading "
              f"{figures['added_ratio']:.2f} x, of which weights {figures['weights_ratio']:.2f} x "
              "(the rest: bounded slots)")
    staging = report["staging"]
    print(f" staging: {staging['mapped_gbps']} GB/s from the mapping, {staging['memory_gbps']} "
          f"GB/s from memory ({staging['mapped_to_memory']:.2f} x)")
    if as_json:
        print(json.dumps(report, sort_keys=True))


def _worker(mode: str) -> None:
    """One serving process: import, wait, load and run one forward, report, wait, exit."""
    import torch
    from diffusers import FluxTransformer2DModel

    from dlo_bench.models import example_inputs
    from dlo_runtime import pod

    torch.set_num_threads(1)
    print("imported", flush=True)
    sys.stdin.readline()
    if mode == "shared":
        dit = pod.build_dit(FluxTransformer2DModel)
    else:
        entry = pod.read_entry_file()
        dit = FluxTransformer2DModel.from_pretrained(entry.path / "transformer",
                                                     low_cpu_mem_usage=False).eval()
    handle = pod.enable(dit, device="cpu")
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # return freed loader buffers before measuring
    with torch.no_grad():
        output = dit(**example_inputs("flux", dit))[0]
    digest = hashlib.sha256(output.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
    print("ready", digest, handle.slot_bytes, flush=True)
    sys.stdin.readline()
    handle.close()


if __name__ == "__main__":
    _worker(sys.argv[1])
