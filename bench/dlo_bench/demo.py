"""`dlo demo`: the whole system on one machine, checked end to end.

Owns the demo's sequence: start a moto S3 server on loopback; write a tiny Flux DiT (real
diffusers class, random weights from a fixed seed) in diffusers layout and upload it; fill three
node caches with three cooperating `dlo cache fill` processes in multi-reader mode (one process
per simulated node, each with its own cache root); run two data-parallel runtime processes
(`dlo_bench.demo_runtime`) in AllGather mode from node0's mapped entry, as a pod would; serve one
image through `dlo serve`'s HTTP API from the same entry and save the PNG
(`dlo_bench.demo_serve`); then print the report of `dlo_bench.demo_report` and exit non-zero on
any failure or mismatch.
Everything it starts (the server, the processes, the work directory) is stopped or removed on
every exit, Ctrl-C and SIGTERM included; `--keep` keeps the work directory and its logs.
Must not be imported by the runtime or the loader.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from dlo_bench.demo_processes import Children, DemoError, sigterm_as_interrupt
from dlo_bench.demo_report import MODES, build_report, compare_outputs, format_report
from dlo_bench.demo_serve import serve_one_image
from dlo_bench.s3server import DUMMY_CREDENTIALS, free_port, start_moto, upload_tree
from dlo_contract.errors import DloError
from dlo_contract.names import CONFIG_ENV, ENTRY_FILE_ENV
from dlo_contract.settings import (
    MIB, CacheConfig, LoaderConfig, OffloadConfig, ParallelConfig, Settings,
)
from dlo_contract.validation import validate

log = logging.getLogger(__name__)

BUCKET = "dlo-demo"
PREFIX = "flux-tiny"
NODES = 3
RANKS = 2
_LOADER = LoaderConfig(path_style=True, readers=4, chunk_bytes=1 * MIB,
                       memory_limit_bytes=16 * MIB, rendezvous_timeout_s=60.0,
                       on_rendezvous_timeout="fail", max_retries=4, timeout_s=120.0)
"""Chunks of 1 MiB so that even a model of a few MiB spreads over three readers; a missing peer
fails the demo rather than silently reading alone."""
_DESCRIBE = {"offloaded": "offloaded (AllGather over gloo, from node0's entry)",
             "resident": "resident (loaded ordinarily from the same files)"}
_TORCH_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
_AMBIENT = (CONFIG_ENV, ENTRY_FILE_ENV, "AWS_PROFILE")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--steps", type=int, default=4, help="Euler steps per run (default: %(default)s)")
    add("--layers", type=int, default=32,
        help="DiT blocks, half of them double-stream (default: %(default)s)")
    add("--head-dim", type=int, default=64,
        help="attention head width; 2 heads (default: %(default)s)")
    add("--seed", type=int, default=0, help="seed of the weights and inputs (default: %(default)s)")
    add("--timeout", type=float, default=150.0, metavar="S",
        help="seconds each group of processes may take (default: %(default)s)")
    add("--image", type=Path, default=Path("dlo-demo.png"), metavar="PATH",
        help="where the PNG served through `dlo serve` is written (default: %(default)s)")
    add("--keep", action="store_true", help="keep the work directory (logs, caches, outputs)")
    add("--json", action="store_true", help="also print the report as one JSON line, last")


def run(args: argparse.Namespace) -> int:
    if args.steps < 1:
        raise DemoError(f"--steps={args.steps} must be 1 or more")
    started = time.monotonic()
    with sigterm_as_interrupt(), ExitStack() as stack:
        work = Path(tempfile.mkdtemp(prefix="dlo-demo-"))
        if args.keep:
            stack.callback(print, f"work directory kept: {work}", file=sys.stderr)
        else:
            stack.callback(shutil.rmtree, work, ignore_errors=True)
        stack.enter_context(_torch_cache_in(work))
        children = stack.enter_context(Children(work / "logs", _child_environment()))
        try:
            report = _demo(args, work, children, stack, started)
        except DloError as exc:
            if args.json:
                print(json.dumps({"status": "error", "error": str(exc)}), flush=True)
            raise
    print(format_report(report))
    if args.json:
        print(json.dumps(report))
    return 0 if report["status"] == "ok" else 1


def _demo(args: argparse.Namespace, work: Path, children: Children, stack: ExitStack,
          started: float) -> dict[str, Any]:
    model = _write_model(args, work / "model", work / "runtime")
    log.info("starting the S3 server (moto) on 127.0.0.1")
    server = stack.enter_context(start_moto())
    upload_tree(server, BUCKET, PREFIX, work / "model")
    model["source"] = f"s3://{BUCKET}/{PREFIX}/"
    loaders = _fill(args, work, children, model["source"], server.endpoint_url)
    env = _runtime_env(work)
    ranks = _serve(args, work, children, env)
    log.info("serving one image through `dlo serve` (%d ranks, AllGather) over HTTP", RANKS)
    served = serve_one_image(children, ranks=RANKS, env=env, steps=args.steps, seed=args.seed,
                             image=args.image, timeout_s=args.timeout)
    return build_report(model=model, loaders=loaders, ranks=ranks, served=served,
                        steps=args.steps, seconds=time.monotonic() - started)


def _write_model(args: argparse.Namespace, model_dir: Path, runtime_dir: Path) -> dict[str, Any]:
    """The model folder to upload (the DiT, a tiny VAE and the scheduler: what `dlo serve`
    runs), plus each rank's fixed inputs; returns the model's description."""
    import torch

    from dlo_bench.models import example_inputs, tiny_model
    from dlo_bench.serve_model import save_pipeline_layout

    log.info("writing a tiny Flux DiT (%d blocks, seed %d) in diffusers layout",
             args.layers, args.seed)
    try:
        dit = tiny_model("flux", seed=args.seed, num_layers=args.layers, head_dim=args.head_dim)
    except ValueError as exc:
        raise DemoError(f"cannot build the demo model: {exc}",
                        hint="pass --layers of 1 or more and --head-dim a multiple of 16") from exc
    save_pipeline_layout(dit, model_dir, seed=args.seed)
    runtime_dir.mkdir(parents=True)
    for rank in range(RANKS):  # data parallel: each rank denoises its own sample
        torch.save(example_inputs("flux", dit, seed=args.seed + rank),
                   runtime_dir / f"inputs{rank}.pt")
    files = [p for p in model_dir.rglob("*") if p.is_file()]
    return {"class": type(dit).__name__, "layers": args.layers, "head_dim": args.head_dim,
            "files": len(files), "bytes": sum(p.stat().st_size for p in files)}


def _fill(args: argparse.Namespace, work: Path, children: Children, source: str,
          endpoint_url: str) -> list[dict[str, Any]]:
    """Three `dlo cache fill` processes, one per node, in multi-reader mode; their summaries."""
    config = work / "loader-settings.json"
    config.write_text(validate(Settings(loader=_LOADER)).to_json())
    port = free_port()
    log.info("filling %d node caches with %d cooperating loaders", NODES, NODES)
    started = []
    for rank in range(NODES):
        node = work / f"node{rank}"
        node.mkdir()
        started.append(children.start(f"loader{rank}", [
            sys.executable, "-m", "dlo_cli.main", "cache", "fill", "--config", str(config),
            "--source", source, "--endpoint-url", endpoint_url, "--mode", "multi-reader",
            "--cache-root", str(node / "cache"), "--rank", str(rank), "--world-size", str(NODES),
            "--master-addr", "127.0.0.1", "--master-port", str(port),
            "--entry-file", str(node / "entry.json"), "--summary-file", str(node / "summary.json"),
        ]))
    children.wait(started, timeout_s=args.timeout, step="cache fill")
    return [_summary(work / f"node{rank}" / "summary.json") for rank in range(NODES)]


def _summary(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise DemoError(f"cache fill: loader summary {path.name} of {path.parent.name} is "
                        f"unreadable: {exc}") from exc


def _runtime_env(work: Path) -> dict[str, str]:
    """What the operator gives a serving pod: the settings document (AllGather over the two
    data-parallel ranks, node0's cache) and node0's entry file."""
    node = work / "node0"
    settings = Settings(offload=OffloadConfig(enabled=True, use_allgather=True),
                        parallel=ParallelConfig(dp=RANKS),
                        cache=CacheConfig(root=str(node / "cache")))
    config = work / "runtime" / "settings.json"
    config.write_text(validate(settings).to_json())
    return {CONFIG_ENV: str(config), ENTRY_FILE_ENV: str(node / "entry.json")}


def _serve(args: argparse.Namespace, work: Path, children: Children,
           env: dict[str, str]) -> list[dict[str, Any]]:
    """Two data-parallel ranks offloaded (AllGather, node0's entry), then the same two ranks
    resident; each rank's figures of both runs and the comparison of its outputs."""
    runtime_dir = work / "runtime"
    for mode in MODES:
        log.info("running %d data-parallel ranks %s for %d steps", RANKS, _DESCRIBE[mode],
                 args.steps)
        world = (["--world-size", str(RANKS), "--port", str(free_port())]
                 if mode == "offloaded" else [])
        started = [children.start(f"{mode}{rank}", [
            sys.executable, "-m", "dlo_bench.demo_runtime", "--mode", mode, "--rank", str(rank),
            *world, "--steps", str(args.steps), "--work", str(runtime_dir)], env=env)
            for rank in range(RANKS)]
        children.wait(started, timeout_s=args.timeout, step=f"runtime ({mode})")
    return [_rank_result(runtime_dir, rank) for rank in range(RANKS)]


def _rank_result(runtime_dir: Path, rank: int) -> dict[str, Any]:
    """One rank's figures of both runs and the comparison of their final latents."""
    import torch

    runs = {mode: json.loads((runtime_dir / f"{mode}{rank}.json").read_text()) for mode in MODES}
    latents = {mode: torch.load(runtime_dir / f"{mode}{rank}.pt") for mode in MODES}
    comparison = compare_outputs(latents["resident"], latents["offloaded"])
    return {"rank": rank, "weightless": runs["offloaded"]["weightless"],
            "backing": runs["offloaded"]["backing"], **runs, "identical": comparison.identical,
            "max_abs_diff": comparison.max_abs_diff}


def _child_environment() -> dict[str, str]:
    """The demo's environment for its children: dummy S3 credentials, one thread per process
    (the ranks and loaders share the machine's cores), and no settings or AWS profile leaking in
    from the caller's shell."""
    env = {k: v for k, v in os.environ.items() if k not in _AMBIENT}
    return {**env, **DUMMY_CREDENTIALS, "AWS_EC2_METADATA_DISABLED": "true", "OMP_NUM_THREADS": "1"}


@contextmanager
def _torch_cache_in(work: Path) -> Iterator[None]:
    """Point torch's compile cache (created by importing `torch._dynamo`, as diffusers does) into
    the work directory for this process and its children, so the demo leaves no directory
    behind; a cache location the caller chose is kept."""
    if _TORCH_CACHE_ENV in os.environ:
        yield
        return
    os.environ[_TORCH_CACHE_ENV] = str(work / "torch-cache")
    try:
        yield
    finally:
        del os.environ[_TORCH_CACHE_ENV]
