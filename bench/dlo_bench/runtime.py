"""`dlo bench runtime`: what the DLO hooks cost, against the resident model in the same run.

Owns the runtime benchmark. On the CPU it measures the host time the hooks spend per streamed
block (slot bookkeeping and repointing, apart from the block copies, which on a GPU run on the
copy stream) against the resident forward, with the run-time statistics on (the default) and
off, in interleaved rounds. On CUDA it also times one step resident, with DLO,
and with diffusers' own block-level group offloading (one block per group, with streams) on the
same model and inputs. Every variant's output is compared with the resident one before any
figure is reported. With `--compiled` it adds the same comparisons under `torch.compile`
(`dlo_bench.runtime_compiled`). The rank-local steps over mapped checkpoint entries of three
layouts are `dlo_bench.runtime_mapped`'s (`--no-mapped` skips them); what the AllGather ranks'
per-forward lockstep check costs against a step, over two gloo ranks, is
`dlo_bench.runtime_lockstep`'s (`--no-allgather` skips it). With `--host-memory ARGS...`
it runs `dlo_bench.host_memory` instead. Must not be imported by the runtime.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from dlo_bench import provenance


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kind", choices=("flux", "sd3", "wan"), default="flux",
                        help="diffusers DiT class (tiny config, random weights)")
    parser.add_argument("--layers", type=int, default=8, help="DiT blocks")
    parser.add_argument("--head-dim", type=int, default=64, help="head width (2 heads)")
    parser.add_argument("--side", type=int, default=16, help="latent height and width")
    parser.add_argument("--batch", type=int, default=2, help="batch size")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleaved rounds of the hook timing, with and without stats")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads for torch; 1 keeps other load from skewing the ratio")
    parser.add_argument("--cuda-head-dim", type=int, default=512,
                        help="head width of the CUDA step-time comparison")
    parser.add_argument("--cuda-side", type=int, default=64,
                        help="latent side of the CUDA step-time comparison")
    parser.add_argument("--no-mapped", action="store_true",
                        help="skip the rank-local steps over mapped checkpoint entries")
    parser.add_argument("--no-allgather", action="store_true",
                        help="skip the two-rank AllGather steps (the lockstep check's cost)")
    parser.add_argument("--compiled", action="store_true",
                        help="also time every variant under torch.compile (minutes on a CPU)")
    parser.add_argument("--compile-mode", choices=("regional", "whole"), default="regional",
                        help="compile_repeated_blocks() or module.compile()")
    parser.add_argument("--json", action="store_true",
                        help="end the output with one JSON line holding every figure")
    parser.add_argument("--host-memory", nargs=argparse.REMAINDER, default=None,
                        metavar="ARGS", help="run the host-memory benchmark with ARGS instead")


def run(args: argparse.Namespace) -> int:
    if args.host_memory is not None:
        return _host_memory(args)
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    report: dict[str, Any] = {
        "benchmark": "runtime",
        "commit": provenance.commit(),
        "machine": provenance.machine() | {
            "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None},
        "parameters": {k: v for k, v in vars(args).items() if k not in ("json", "host_memory")},
    }
    figures = _cpu_hooks(args)
    if not args.no_mapped:
        from dlo_bench import runtime_mapped

        figures |= runtime_mapped.cpu_mapped(args)
    if not args.no_allgather:
        from dlo_bench import runtime_lockstep

        figures |= runtime_lockstep.cpu_lockstep(args)
    if args.compiled:
        from dlo_bench import runtime_compiled

        figures |= runtime_compiled.cpu_compiled(args, _timed_steps, _settings())
    if torch.cuda.is_available():
        figures |= _cuda_steps(args)
        if args.compiled:
            figures |= runtime_compiled.cuda_compiled(args, _timed_steps, _settings())
    report["figures"] = figures
    failed = [name for name, value in figures.items() if name.endswith("_equal") and not value]
    for name, value in figures.items():
        print(f"{name:44s} {value:.4g}" if isinstance(value, float) else f"{name:44s} {value}")
    if args.json:
        print(json.dumps(report, sort_keys=True))
    if failed:
        print(f"bench runtime: outputs differ from the resident model: {', '.join(failed)}",
              file=sys.stderr)
        return 1
    return 0


def _host_memory(args: argparse.Namespace) -> int:
    from dlo_bench import host_memory

    parser = argparse.ArgumentParser(prog="dlo bench runtime --host-memory")
    host_memory.add_arguments(parser)
    extra = ["--json"] if args.json and "--json" not in args.host_memory else []
    return host_memory.run(parser.parse_args([*args.host_memory, *extra]))


def _settings() -> Any:
    from dlo_contract.settings import OffloadConfig, Settings

    return Settings(offload=OffloadConfig(use_allgather=False))


def _timed_steps(step: Callable[[], Any], args: argparse.Namespace, sync: Callable[[], None]
                 ) -> float:
    """Median seconds of one step, after `args.warmup` untimed ones."""
    for _ in range(args.warmup):
        step()
    sync()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def model_step(args: argparse.Namespace) -> tuple[Any, Callable[[], Any]]:
    """The benchmark's model (`--kind`, `--layers`, `--head-dim`) and one step of it on its
    inputs (`--batch`, `--side`), under inference mode."""
    import torch

    from dlo_bench.models import example_inputs, tiny_model

    model = tiny_model(args.kind, num_layers=args.layers, head_dim=args.head_dim)
    inputs = example_inputs(args.kind, model, batch=args.batch, side=args.side)

    def step() -> torch.Tensor:
        with torch.inference_mode():
            return model(**inputs)[0]

    return model, step


def _cpu_hooks(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from dlo_runtime.backend import DistributedLayerwiseOffloadBackend

    model, step = model_step(args)
    expected = step()
    resident_s = _timed_steps(step, args, lambda: None)
    with DistributedLayerwiseOffloadBackend(model, settings=_settings(), device="cpu") as backend:
        equal = torch.equal(step(), expected)
        dlo_s = _timed_steps(step, args, lambda: None)
        blocks = len(backend.layouts)
        steps_blocks = args.steps * blocks
        _wrap_hooks(backend)
        # Interleaved rounds with statistics on and off; the least of each is the one the
        # other processes on the machine disturbed least.
        rounds: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
        recorder = backend._scheduler.stats
        for _ in range(args.rounds):
            for with_stats in (True, False):
                backend._scheduler.stats = recorder if with_stats else _NoStats()
                rounds[with_stats].append(_instrumented(backend, step, args))
        backend._scheduler.stats = recorder
        recorder_us = _recorder_us_per_block(backend)
    hook_s, copy_s = min(rounds[True], key=lambda r: r[0] - r[1])
    bare_hook_s, bare_copy_s = min(rounds[False], key=lambda r: r[0] - r[1])
    hook_us = hook_s / steps_blocks * 1e6
    copy_us = copy_s / steps_blocks * 1e6
    bare_overhead_us = (bare_hook_s - bare_copy_s) / steps_blocks * 1e6
    resident_block_us = resident_s / args.layers * 1e6
    return {
        "cpu_hook_overhead_without_stats_us_per_block": bare_overhead_us,
        "cpu_stats_cost_us_per_block": hook_us - copy_us - bare_overhead_us,
        "cpu_stats_recorder_us_per_block": recorder_us,
        "cpu_dlo_equal": equal,
        "cpu_streamed_blocks": blocks,
        "cpu_resident_step_us": resident_s * 1e6,
        "cpu_dlo_step_us": dlo_s * 1e6,
        "cpu_dlo_step_ratio": dlo_s / resident_s,
        "cpu_resident_us_per_block": resident_block_us,
        "cpu_hook_us_per_block": hook_us,
        "cpu_copy_us_per_block": copy_us,
        "cpu_hook_overhead_us_per_block": hook_us - copy_us,
        "cpu_hook_overhead_ratio": (hook_us - copy_us) / resident_block_us,
    }


class _NoStats:
    """The recorder's interface doing nothing: the hooks' cost without statistics."""

    def loaded(self, index: int) -> None:
        return None

    def copy_started(self) -> float:
        return 0.0

    def copy_ended(self, started: float) -> None:
        return None

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)


def _recorder_us_per_block(backend: Any, calls: int = 20000) -> float:
    """Microseconds the statistics add to one block, timed alone: what a block's hooks call on
    the recorder (a load counted and timed, a wait on a ready slot), in a tight loop."""
    recorder, streams = backend._scheduler.stats, backend._streams
    slot = backend.slots[0]
    start = time.perf_counter()
    for _ in range(calls):
        recorder.loaded(0)
        recorder.copy_ended(recorder.copy_started())
        recorder.wait(streams.compute(), slot.ready)
    return (time.perf_counter() - start) / calls * 1e6


_SPENT = {"hooks": 0.0, "copies": 0.0}


def _wrap_hooks(backend: Any) -> None:
    """Time the scheduler's hook entry points and the copies they issue into `_SPENT`."""

    def timed(function: Callable[..., Any], bucket: str) -> Callable[..., Any]:
        def wrapper(*a: Any, **kw: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*a, **kw)
            finally:
                _SPENT[bucket] += time.perf_counter() - start
        return wrapper

    scheduler, source = backend._scheduler, backend._source
    for name in ("acquire", "prefetch", "release"):
        setattr(scheduler, name, timed(getattr(scheduler, name), "hooks"))
    source.load = timed(source.load, "copies")


def _instrumented(backend: Any, step: Callable[[], Any], args: argparse.Namespace
                  ) -> tuple[float, float]:
    """Seconds spent in the hooks, and in the block copies they issue, over `args.steps`."""
    for _ in range(args.warmup):
        step()
    _SPENT.update(hooks=0.0, copies=0.0)
    for _ in range(args.steps):
        step()
    return _SPENT["hooks"], _SPENT["copies"]


def _cuda_steps(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from diffusers.hooks import apply_group_offloading

    from dlo_bench.models import example_inputs, tiny_model
    from dlo_runtime.backend import DistributedLayerwiseOffloadBackend

    device = torch.device("cuda")
    sync = torch.cuda.synchronize

    def build() -> Any:
        return tiny_model(args.kind, num_layers=args.layers, head_dim=args.cuda_head_dim,
                          dtype=torch.bfloat16)

    def measure(model: Any) -> tuple[float, Any, int]:
        inputs = example_inputs(args.kind, model, batch=args.batch, side=args.cuda_side)
        inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in inputs.items()}

        def step() -> Any:
            with torch.inference_mode():
                return model(**inputs)[0]

        torch.cuda.reset_peak_memory_stats()
        seconds = _timed_steps(step, args, sync)
        return seconds, step(), torch.cuda.max_memory_allocated()

    resident = build().to(device)
    resident_s, expected, resident_peak = measure(resident)
    del resident
    torch.cuda.empty_cache()
    dlo_model = build()
    with DistributedLayerwiseOffloadBackend(dlo_model, settings=_settings(), device=device):
        dlo_s, dlo_out, dlo_peak = measure(dlo_model)
    del dlo_model
    torch.cuda.empty_cache()
    group_model = build()
    apply_group_offloading(group_model, onload_device=device, offload_type="block_level",
                           num_blocks_per_group=1, use_stream=True)
    group_s, group_out, group_peak = measure(group_model)
    return {
        "cuda_dlo_equal": torch.equal(dlo_out, expected),
        "cuda_group_offload_matches_resident": torch.equal(group_out, expected),
        "cuda_resident_step_ms": resident_s * 1e3,
        "cuda_dlo_step_ms": dlo_s * 1e3,
        "cuda_group_offload_step_ms": group_s * 1e3,
        "cuda_dlo_vs_resident_ratio": dlo_s / resident_s,
        "cuda_dlo_vs_group_offload_ratio": dlo_s / group_s,
        "cuda_resident_peak_bytes": resident_peak,
        "cuda_dlo_peak_bytes": dlo_peak,
        "cuda_group_offload_peak_bytes": group_peak,
    }


