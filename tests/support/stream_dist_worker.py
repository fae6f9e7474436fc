"""Body of each gloo process started by `test_backend_allgather_fast.py`: AllGather mode on the
asynchronous stream model (`support.async_streams`), so the copy of this rank's shard, the
AllGather and the compute that reads the gathered block run in separately scheduled queues.
Writes each case's outcome as JSON for the test to read."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from support.async_streams import AsyncStreamSet, Schedule
from support.gloo_world import in_gloo_rank
from support.runtime_helpers import forward, offload_settings, run_case

from dlo_bench.models import example_inputs, tiny_model
from dlo_runtime.backend import DistributedLayerwiseOffloadBackend


def _skip_case(world: int, group: dist.ProcessGroup) -> dict[str, bool]:
    """SD3 skipping a block: its prefetched, gathered slot is reloaded with the next block."""
    reference = tiny_model("sd3")
    inputs = example_inputs("sd3", reference)
    expected_skip = forward(reference, inputs | {"skip_layers": [1]})
    expected = forward(reference, inputs)
    model = tiny_model("sd3")
    streams = AsyncStreamSet(Schedule.LAZY)
    with streams:
        with DistributedLayerwiseOffloadBackend(
            model, settings=offload_settings(dp=world), device="cpu", group=group,
            streams=streams,
        ):
            skipped = torch.equal(forward(model, inputs | {"skip_layers": [1]}), expected_skip)
            whole = torch.equal(forward(model, inputs), expected)
    return {"equal_skip": skipped, "equal": whole}


def main(rank: int, world: int, port: int, out_dir: str) -> None:
    in_gloo_rank(rank, world, port, out_dir, _outcomes)


def _outcomes(world: int, group: dist.ProcessGroup) -> dict[str, Any]:
    dp = offload_settings(dp=world)
    outcomes: dict[str, object] = {
        "flux-dp-lazy": dataclasses.asdict(
            run_case("flux", dp, group=group, streams=AsyncStreamSet(Schedule.LAZY))
        ),
        "sd3-skip-dp-lazy": _skip_case(world, group),
    }
    return outcomes
