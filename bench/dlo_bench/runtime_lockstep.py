"""What the per-forward lockstep check of AllGather mode costs, against a step in the same run.

Owns the `cpu_allgather_*` figures of `dlo bench runtime`: two gloo ranks on loopback (one CPU
thread each) enable DLO in AllGather mode on the same model, check the offloaded output against
the resident one, then time steps in interleaved rounds with the check on and with it replaced
by its counter alone (both ranks switch together, so their collectives still pair), and the
check's own round trip between ranks in step. Figures: the step time, the check's time and its
share of a step, and the ratio of the steps with and without it. Called by
`dlo_bench.runtime`; must not be imported by the runtime.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

WORLD = 2
CHECKS = 200
"""Back-to-back checks timed for the check's own cost."""


def cpu_lockstep(args: argparse.Namespace) -> dict[str, Any]:
    """Start the ranks and return rank 0's figures (every rank's output must be exact)."""
    import torch.multiprocessing as mp

    from dlo_bench.s3server import free_port

    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_rank, args=(vars(args), free_port(), out), nprocs=WORLD)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(WORLD)]
    figures = ranks[0]
    figures["cpu_allgather_equal"] = all(rank["cpu_allgather_equal"] for rank in ranks)
    return figures


def _rank(rank: int, params: dict[str, Any], port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(params["threads"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    try:
        figures = _measure(argparse.Namespace(**params))
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(figures))


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from dlo_bench.runtime import model_step
    from dlo_contract.settings import ParallelConfig, Settings
    from dlo_runtime.backend import DistributedLayerwiseOffloadBackend

    model, step = model_step(args)
    expected = step()
    settings = Settings(parallel=ParallelConfig(dp=WORLD))
    with DistributedLayerwiseOffloadBackend(model, settings=settings, device="cpu") as backend:
        equal = torch.equal(step(), expected)
        lockstep = backend._lockstep
        assert lockstep is not None
        checked = lockstep.start_forward

        def counted_only() -> None:
            lockstep.forwards += 1

        rounds: dict[str, list[float]] = {"on": [], "off": []}
        for _ in range(args.warmup):
            step()
        for _ in range(args.rounds):
            for variant, check in (("on", checked), ("off", counted_only)):
                lockstep.start_forward = check  # type: ignore[method-assign]
                rounds[variant].append(_median_seconds(step, args.steps))
        lockstep.start_forward = checked  # type: ignore[method-assign]
        # The check's own cost between ranks in step, without the wait for a slower rank that
        # the first block's gather would absorb anyway; every rank makes the same calls.
        dist.barrier()
        check_s = _median_seconds(checked, CHECKS)
    on_s, off_s = min(rounds["on"]), min(rounds["off"])
    return {
        "cpu_allgather_equal": equal,
        "cpu_allgather_step_us": on_s * 1e6,
        "cpu_allgather_check_us_per_forward": check_s * 1e6,
        "cpu_allgather_check_share_of_step": check_s / on_s,
        "cpu_allgather_step_ratio_check_on_off": on_s / off_s,
    }


def _median_seconds(call: Callable[[], Any], times: int) -> float:
    spent = []
    for _ in range(times):
        start = time.perf_counter()
        call()
        spent.append(time.perf_counter() - start)
    return statistics.median(spent)
