"""Body of each gloo process started by `test_backend_distributed.py`.

Every rank builds the same seeded models, makes the process group that stands for the server's
existing DP (or SP) group, runs each case and writes its outcomes as JSON for the test to read.
Some cases run on the asynchronous stream model (`support.async_streams`), so ranks 1 and 2 also
gather with their copies, AllGathers and compute in separately scheduled queues.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from support.async_streams import AsyncStreamSet, Schedule
from support.gloo_world import in_gloo_rank
from support.runtime_helpers import (
    Outcome,
    forward,
    mapped_plan,
    offload_settings,
    run_case,
    strip_parameters,
)
from support.runtime_models import OnDemandDiT, on_demand_inputs, seeded

from dlo_bench.models import tiny_model
from dlo_runtime.backend import DistributedLayerwiseOffloadBackend, host_bytes
from dlo_runtime.host_weight_plan import HostWeightPlan, runtime_tensors
from dlo_runtime.tensors import OffloadError


def _cases(world: int, group: dist.ProcessGroup) -> tuple[dict[str, Outcome], bool]:
    """Every case's outcome, and whether the mapped plan's sources were released."""
    dp = offload_settings(dp=world)
    sp = offload_settings(dp=1, sp=world)
    plan_model = tiny_model("sd3", seed=3)
    plan = HostWeightPlan.ordinary(runtime_tensors(plan_model))
    del plan_model
    mapped, mapping = mapped_plan(tiny_model("flux", seed=4))
    outcomes = {
        "flux-dp": run_case("flux", dp, group=group),
        "sd3-dp": run_case("sd3", dp, group=group),
        "wan-dp": run_case("wan", dp, group=group),
        "wan-bf16-mixed-dp": run_case("wan", dp, group=group, dtype=torch.bfloat16,
                                      streams=AsyncStreamSet(Schedule.EAGER)),
        "flux-sp": run_case("flux", sp, group=group, num_layers=7,
                            streams=AsyncStreamSet(Schedule.LAZY)),
        "wan-sp": run_case("wan", sp, group=group, num_layers=1),
        "sd3-plan-dp": run_case("sd3", dp, group=group, host_plan=plan, seed=3),
        "wan-dp-default-group": run_case("wan", dp, num_layers=2),
        "flux-mapped-plan-dp": run_case("flux", dp, group=group, host_plan=mapped, seed=4,
                                        streams=AsyncStreamSet(Schedule.LAZY)),
    }
    return outcomes, mapping.closed


def _on_demand_case(world: int, group: dist.ProcessGroup) -> dict[str, object]:
    """A model with on-demand modules over a mapped plan: the mapping is released once the
    shards are made, so on-demand weights must come from this rank's own whole copies."""
    reference = seeded(OnDemandDiT)
    inputs = on_demand_inputs()
    expected = forward(reference, inputs)
    plan, mapping = mapped_plan(reference)
    model = seeded(OnDemandDiT, seed=9)
    strip_parameters(model)
    backend = DistributedLayerwiseOffloadBackend(
        model, settings=offload_settings(dp=world), device="cpu", group=group, host_plan=plan
    )
    with backend:
        assert backend._on_demand is not None
        outcome: dict[str, object] = {
            "equal": torch.equal(forward(model, inputs), expected),
            "equal_second_step": torch.equal(forward(model, inputs), expected),
            "released_while_enabled": mapping.closed,
            "on_demand_host_bytes": host_bytes(backend._on_demand.host_tensors()),
            "on_demand_bytes": backend._on_demand.tensor_bytes,
            "mode": backend.mode,
        }
    outcome["equal_after_disable"] = torch.equal(forward(model, inputs), expected)
    return outcome


def _group_size_error(world: int, group: dist.ProcessGroup) -> str:
    try:
        DistributedLayerwiseOffloadBackend(
            tiny_model("wan"), settings=offload_settings(dp=world + 1), device="cpu", group=group
        )
    except OffloadError as exc:
        return str(exc)
    return "no error"


def main(rank: int, world: int, port: int, out_dir: str) -> None:
    in_gloo_rank(rank, world, port, out_dir, _outcomes)


def _outcomes(world: int, group: dist.ProcessGroup) -> dict[str, Any]:
    outcomes, released = _cases(world, group)
    plain: dict[str, object] = {
        name: dataclasses.asdict(o) for name, o in outcomes.items()
    }
    plain["group-size-error"] = _group_size_error(world, group)
    plain["mapped-plan-released"] = released
    plain["on-demand-dp"] = _on_demand_case(world, group)
    return plain
