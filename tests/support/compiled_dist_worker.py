"""Body of each gloo process started by `test_backend_compiled_distributed.py`: compiled DLO in
AllGather mode over the world group, each case's outcome written as JSON for the test to read."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from support.compiled_helpers import COMPILES, compiled_case
from support.runtime_helpers import offload_settings

CASES = {
    "flux-regional": ("flux", "regional", "enable-first"),
    "two-stack-whole": ("two-stack", "whole", "run-first"),
}
"""Case name -> (model kind, how it is compiled, order of enabling and compiling)."""


def main(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        group = dist.new_group(list(range(world)))
        settings = offload_settings(dp=world)
        outcomes = {
            name: dataclasses.asdict(
                compiled_case(kind, settings, COMPILES[how], group=group, order=order)
            )
            for name, (kind, how, order) in CASES.items()
        }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(outcomes))
    finally:
        dist.destroy_process_group()
