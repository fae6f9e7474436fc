"""`dlo bench serve`: requests/s and p50/p99 latency of `dlo serve` offloaded (AllGather over G
ranks) against the same server with the model resident, and against a resident pipeline called
directly (no HTTP, no queue), in one run on this machine's CPU.

Owns the benchmark's sequence: write a tiny random-weight Flux pipeline (its real CLIP and T5
text encoders and tokenizers, `serve_model`) and publish it as a checkpoint entry (the loader's
stand-in), then for each server mode start `dlo serve` (G ranks,
one thread each), warm every step count up, and send `--requests` requests (steps cycling
through `--steps`) from `--concurrency` client threads; each answer is checked against the
direct diffusers pipeline's PNG of the same job, bit for bit. It also times what an idle rank
of an AllGather wave adds over a gather-only step: the wave's first job run again to its
latents, compute only (resident), against a real job. Prints a report, then one JSON line with `--json`.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from dlo_bench.demo_processes import Children
from dlo_bench.demo_serve import post_json, start_server, wait_ready

MODES = ("resident", "offloaded")
"""Server modes: `offload.enabled` false, then true with AllGather over the ranks."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--ranks", type=int, default=2, help="data-parallel ranks (default: %(default)s)")
    add("--requests", type=int, default=24, help="timed requests per mode (default: %(default)s)")
    add("--concurrency", type=int, default=4, help="client threads (default: %(default)s)")
    add("--steps", default="2,3,4", help="step counts, cycled (default: %(default)s)")
    add("--size", type=int, default=32, help="image width and height (default: %(default)s)")
    add("--layers", type=int, default=8, help="DiT blocks (default: %(default)s)")
    add("--head-dim", type=int, default=32, help="attention head width (default: %(default)s)")
    add("--timeout", type=float, default=300.0, metavar="S",
        help="seconds a server may take to be ready, or a request to be answered")
    add("--json", action="store_true", help="also print the results as one JSON line, last")


def run(args: argparse.Namespace) -> int:
    steps = [int(part) for part in args.steps.split(",")]
    jobs = [_job(index, steps[index % len(steps)], args.size) for index in range(args.requests)]
    with tempfile.TemporaryDirectory(prefix="dlo-bench-serve-") as scratch:
        work = Path(scratch)
        envs = _publish(args, work)
        direct, pngs, idle = _direct(work / "model", jobs, steps)
        modes = {}
        with Children(work / "logs", {**os.environ, "OMP_NUM_THREADS": "1"}) as children:
            for mode in MODES:
                modes[mode] = _serve_mode(args, children, mode, envs[mode], jobs, steps, pngs)
    result = _result(args, steps, direct, modes, idle)
    print(_format(result))
    if args.json:
        print(json.dumps(result))
    return 0 if result["identical"] else 1


def _job(index: int, steps: int, size: int) -> dict[str, Any]:
    return {"prompt": f"prompt {index}", "width": size, "height": size, "steps": steps,
            "guidance_scale": 3.5, "seed": index}


def _publish(args: argparse.Namespace, work: Path) -> dict[str, dict[str, str]]:
    """The model folder, its entry in a scratch cache, and each mode's settings document."""
    from dlo_bench.entries import publish_layout
    from dlo_bench.models import tiny_model
    from dlo_bench.serve_model import save_pipeline_layout
    from dlo_contract.names import CONFIG_ENV, ENTRY_FILE_ENV
    from dlo_contract.settings import CacheConfig, OffloadConfig, ParallelConfig, Settings
    from dlo_contract.validation import validate

    model = save_pipeline_layout(tiny_model("flux", num_layers=args.layers,
                                            head_dim=args.head_dim), work / "model")
    entry = publish_layout(work / "cache", model, "s3://bench/flux-tiny/")
    (work / "entry.json").write_text(entry.to_json())
    envs = {}
    for mode in MODES:
        settings = Settings(offload=OffloadConfig(enabled=mode == "offloaded", use_allgather=True),
                            parallel=ParallelConfig(dp=args.ranks),
                            cache=CacheConfig(root=str(work / "cache")))
        document = work / f"{mode}.json"
        document.write_text(validate(settings).to_json())
        envs[mode] = {CONFIG_ENV: str(document), ENTRY_FILE_ENV: str(work / "entry.json")}
    return envs


def _direct(model: Path, jobs: list[dict[str, Any]], steps: list[int]
            ) -> tuple[dict[str, Any], list[bytes], dict[str, Any]]:
    """The resident pipeline called in this process, one thread, one job after another: its
    figures, each job's PNG (the reference), and the idle-rank figures."""
    import torch

    from dlo_bench.serve_model import direct_pipeline
    from dlo_server.pipeline import FAMILIES
    from dlo_server.requests import Job
    from dlo_server.sampler import Sampler

    torch.set_num_threads(1)
    pipeline = direct_pipeline(model)
    sampler = Sampler(pipeline, FAMILIES[type(pipeline).__name__])
    for count in steps:  # warm-up
        sampler.generate(Job(**{**jobs[0], "steps": count}))
    seconds, pngs = [], []
    for job in jobs:
        started = time.perf_counter()
        [png] = sampler.generate(Job(**job))
        pngs.append(png)
        seconds.append(time.perf_counter() - started)
    idle = []
    for count in steps:
        started = time.perf_counter()
        sampler.idle(Job(**{**jobs[0], "steps": count}))
        idle.append((time.perf_counter() - started) / count)
    per_step = statistics.median(s / job["steps"] for s, job in zip(seconds, jobs))
    figures = {"requests_per_s": len(jobs) / sum(seconds), "p50_s": _quantile(seconds, 0.5),
               "p99_s": _quantile(seconds, 0.99)}
    idle_figures = {"idle_forward_compute_s": statistics.median(idle), "job_step_s": per_step,
                    "idle_to_job_step_ratio": statistics.median(idle) / per_step}
    return figures, pngs, idle_figures


def _serve_mode(args: argparse.Namespace, children: Children, mode: str, env: dict[str, str],
                jobs: list[dict[str, Any]], steps: list[int], pngs: list[bytes]
                ) -> dict[str, Any]:
    """One server run: warm-up, the timed requests, the comparison, SIGTERM."""
    server, url = start_server(children, f"server-{mode}", ranks=args.ranks, env=env)
    wait_ready(server, url, args.timeout)
    endpoint = f"{url}/v1/images/generations"

    def ask(job: dict[str, Any]) -> tuple[float, bytes]:
        body = {"prompt": job["prompt"], "size": f"{job['width']}x{job['height']}",
                "num_inference_steps": job["steps"], "seed": job["seed"]}
        started = time.perf_counter()
        answer = post_json(endpoint, body, args.timeout)
        return time.perf_counter() - started, base64.b64decode(answer["data"][0]["b64_json"])

    with ThreadPoolExecutor(args.concurrency) as pool:
        list(pool.map(ask, [{**jobs[0], "steps": count} for count in steps for _ in
                            range(args.ranks)]))  # warm-up: every step count, full waves
        started = time.perf_counter()
        answers = list(pool.map(ask, jobs))
        wall = time.perf_counter() - started
    server.process.terminate()
    code = server.process.wait(timeout=args.timeout)
    latencies = [seconds for seconds, _ in answers]
    return {"requests_per_s": len(jobs) / wall, "p50_s": _quantile(latencies, 0.5),
            "p99_s": _quantile(latencies, 0.99), "exit_status": code,
            "identical": all(png == want for (_, png), want in zip(answers, pngs))}


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _result(args: argparse.Namespace, steps: list[int], direct: dict[str, Any],
            modes: dict[str, dict[str, Any]], idle: dict[str, Any]) -> dict[str, Any]:
    from dlo_bench import provenance

    offloaded, resident = modes["offloaded"], modes["resident"]
    return {
        "bench": "serve", "ranks": args.ranks, "requests": args.requests,
        "concurrency": args.concurrency, "steps": steps, "size": args.size,
        "layers": args.layers, "head_dim": args.head_dim,
        "direct_resident": _rounded(direct), **{mode: _rounded(modes[mode]) for mode in MODES},
        "offloaded_to_resident_rps_ratio": round(offloaded["requests_per_s"]
                                                 / resident["requests_per_s"], 3),
        "offloaded_to_resident_p50_ratio": round(offloaded["p50_s"] / resident["p50_s"], 3),
        "idle_rank": _rounded(idle),
        # The offloaded server's images must be the direct pipeline's. The resident server's
        # DiT is diffusers' own load (tensors at the file's unaligned offsets), whose CPU
        # kernels may round apart from the aligned reference: reported, not required.
        "identical": offloaded["identical"]
                     and all(modes[mode]["exit_status"] == 0 for mode in MODES),
        "resident_identical": resident["identical"],
        "commit": provenance.commit(), "machine": provenance.machine(),
    }


def _rounded(figures: dict[str, Any]) -> dict[str, Any]:
    return {key: round(value, 4) if isinstance(value, float) else value
            for key, value in figures.items()}


def _format(result: dict[str, Any]) -> str:
    lines = [f"dlo serve, {result['ranks']} ranks, {result['requests']} requests of "
             f"{result['size']}x{result['size']} with steps {result['steps']}, "
             f"{result['concurrency']} clients (tiny Flux, {result['layers']} blocks, CPU)"]
    for name, key in (("resident pipeline, direct", "direct_resident"),
                      ("server, resident", "resident"), ("server, offloaded", "offloaded")):
        figures = result[key]
        lines.append(f"  {name + ':':27} {figures['requests_per_s']:6.2f} requests/s, "
                     f"p50 {figures['p50_s'] * 1000:7.1f} ms, p99 {figures['p99_s'] * 1000:7.1f} ms")
    idle = result["idle_rank"]
    lines.append(f"  idle rank: the wave's first job run again to its latents computes "
                 f"{idle['idle_forward_compute_s'] * 1000:.2f} ms per step, "
                 f"{idle['idle_to_job_step_ratio']:.1%} of a real job's step: what a "
                 "gather-only step would save at most")
    lines.append(f"  images equal to the direct resident pipeline's: "
                 f"{'yes' if result['identical'] else 'NO'} (offloaded server), "
                 f"{'yes' if result['resident_identical'] else 'no'} (resident server)")
    return "\n".join(lines)
