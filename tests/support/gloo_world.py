"""Start a world of real gloo ranks for a test module: each rank runs a worker's `main(rank,
world, port, out_dir)` and writes `rank<r>.json`; the results come back in rank order. A worker's
`main` hands its cases to `in_gloo_rank`, which owns the rank's process group.

Ranks are forked from one fork server per test session that has imported torch, dynamo, inductor,
the runtime and the diffusers DiTs once and frozen their objects out of garbage collection
(`support.frozen_imports`): a freshly spawned rank spent most of its setup importing them again,
and every enable and disable walking them. Each rank is still its own process with its own gloo
group; the server has run no torch op, so no thread pool or process group crosses the fork."""

from __future__ import annotations

import json
import multiprocessing
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from dlo_bench.s3server import free_port


def run_world(main: Callable[..., None], world: int, out_dir: Path) -> list[dict[str, Any]]:
    """Run `main` on `world` ranks forked from the session's fork server (their failure fails
    the caller) and read each rank's JSON result."""
    # Takes effect when the first world starts the server; later calls change nothing.
    multiprocessing.set_forkserver_preload(["support.frozen_imports"])
    mp.start_processes(main, args=(world, free_port(), str(out_dir)), nprocs=world,
                       start_method="forkserver")
    return [json.loads(Path(out_dir, f"rank{rank}.json").read_text()) for rank in range(world)]


def in_gloo_rank(rank: int, world: int, port: int, out_dir: str,
                 cases: Callable[[int, dist.ProcessGroup], dict[str, Any]]) -> None:
    """One rank: one CPU thread, a gloo group of `world` ranks on loopback, `cases(world, group)`
    written to `rank<r>.json`, the process group destroyed whatever happens."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        outcomes = cases(world, dist.new_group(list(range(world))))
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(outcomes))
    finally:
        dist.destroy_process_group()
