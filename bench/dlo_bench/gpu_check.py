"""`dlo bench gpu-check` (`make gpu-check`): every check that needs a GPU, in one command.

Owns the GPU session: runs `tests/gpu` under pytest, then the CUDA step-time benchmark on
Flux-size blocks (FluxTransformer2DModel with Flux.1's widths, fewer blocks, bfloat16): one step
resident, with DLO rank-local, and with diffusers' block-level group offloading (one block per
group, with streams), on the same weights and inputs, every output compared with the resident
one first; with two or more GPUs also DLO AllGather over two NCCL ranks. It measures the pinned
host-to-device peak of the machine in the same run, and reports DLO's step-time ratio to resident
and to group offloading, the H2D rate DLO reached against that peak, and the backend's own
statistics. Writes one JSON document to `--out` (default `$OUT`, else `bench/results/`) as
`gpu_check.json`. Without CUDA it prints that it skipped and returns 0. Sized to finish in under
8 minutes on one H200. Must not be imported by the runtime.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

from dlo_bench import provenance

ROOT = Path(__file__).resolve().parents[2]
FLUX_WIDTHS = {"attention_head_dim": 128, "num_attention_heads": 24, "in_channels": 64,
               "joint_attention_dim": 4096, "pooled_projection_dim": 768,
               "axes_dims_rope": (16, 56, 56)}
"""Flux.1's block widths: each double block holds 339 M parameters, each single block 142 M."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=None,
                        help="folder for gpu_check.json (default $OUT, else bench/results)")
    parser.add_argument("--double", type=int, default=4, help="Flux double-stream blocks")
    parser.add_argument("--single", type=int, default=8, help="Flux single-stream blocks")
    parser.add_argument("--batch", type=int, default=4,
                        help="batch size; 4 at 1024x1024 makes a block's compute exceed its copy")
    parser.add_argument("--image-tokens", type=int, default=4096, help="latent tokens (64x64)")
    parser.add_argument("--text-tokens", type=int, default=512, help="text tokens")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    parser.add_argument("--skip-tests", action="store_true", help="only the benchmark")


def run(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        print("gpu-check: skipped: no CUDA device here (torch.cuda.is_available() is False)")
        return 0
    out = Path(args.out or os.environ.get("OUT") or ROOT / "bench" / "results")
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "benchmark": "gpu-check",
        "commit": provenance.commit(),
        "machine": provenance.machine() | {
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]},
        "parameters": {k: v for k, v in vars(args).items() if k not in ("out", "debug")},
    }
    started = time.perf_counter()
    tests_ok = True
    if not args.skip_tests:
        report["tests"] = _gpu_tests(out)
        tests_ok = report["tests"]["exit_code"] == 0
    from dlo_bench import gpu_steps

    report["figures"] = gpu_steps.rank_local(args)
    if torch.cuda.device_count() >= 2:
        report["figures"] |= gpu_steps.allgather(args)
    report["seconds"] = round(time.perf_counter() - started, 1)
    path = out / "gpu_check.json"
    path.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    for name, value in report["figures"].items():
        print(f"{name:44s} {value:.4g}" if isinstance(value, float) else f"{name:44s} {value}")
    print(f"gpu-check: wrote {path} in {report['seconds']} s")
    unequal = [k for k, v in report["figures"].items() if k.endswith("_equal") and not v]
    if unequal:
        print(f"gpu-check: outputs differ from the resident model: {', '.join(unequal)}",
              file=sys.stderr)
    return 0 if tests_ok and not unequal else 1


def _gpu_tests(out: Path) -> dict[str, Any]:
    """Run `tests/gpu` in a child pytest; its counts come from the JUnit XML it writes."""
    junit = out / "gpu_tests.xml"
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu",
         f"--junitxml={junit}"], cwd=ROOT, timeout=300, check=False)
    suite = ElementTree.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    return {"exit_code": done.returncode, "seconds": round(time.perf_counter() - started, 1),
            **counts}
