"""Body of each gloo process started by `test_backend_compiled_distributed.py`: compiled DLO in
AllGather mode over the world group, each case's outcome written as JSON for the test to read."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.distributed as dist
from support.compiled_helpers import COMPILES, compiled_case
from support.gloo_world import in_gloo_rank
from support.runtime_helpers import offload_settings

CASES = {
    "flux-regional": ("flux", "regional", "enable-first"),
    "two-stack-whole": ("two-stack", "whole", "run-first"),
}
"""Case name -> (model kind, how it is compiled, order of enabling and compiling)."""


def main(rank: int, world: int, port: int, out_dir: str) -> None:
    in_gloo_rank(rank, world, port, out_dir, _outcomes)


def _outcomes(world: int, group: dist.ProcessGroup) -> dict[str, Any]:
    settings = offload_settings(dp=world)
    outcomes = {
        name: dataclasses.asdict(
            compiled_case(kind, settings, COMPILES[how], group=group, order=order)
        )
        for name, (kind, how, order) in CASES.items()
    }
    return outcomes
