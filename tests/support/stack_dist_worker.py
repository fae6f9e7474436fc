"""Body of each gloo process started by `test_stack_distributed.py`.

Every rank builds the same seeded two-stack DiTs (and the three with built-in plans), enables DLO
in AllGather mode over the group, runs three forwards and writes, per model, whether each equals
the resident output bit for bit, the learned run order and the statistics. A last case runs the
blocks in a different order on each rank, which the backend must refuse by name.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from support.gloo_world import in_gloo_rank
from support.runtime_helpers import forward, offload_settings
from support.stack_models import STACK_MODELS, stack_inputs, stack_model
from torch import nn

from dlo_bench.models import KINDS, example_inputs, tiny_model
from dlo_runtime.backend import DistributedLayerwiseOffloadBackend
from dlo_runtime.tensors import OffloadError


def _case(model: nn.Module, reference: nn.Module, inputs: dict[str, Any],
          group: dist.ProcessGroup, world: int) -> dict[str, Any]:
    expected = forward(reference, inputs)
    backend = DistributedLayerwiseOffloadBackend(
        model, settings=offload_settings(dp=world), device="cpu", group=group)
    with backend:
        equal = [torch.equal(forward(model, inputs), expected) for _ in range(3)]
        assert backend._order is not None
        outcome = {
            "equal": equal, "mode": backend.mode, "order": backend._order.run_order(),
            "share": backend.streamed_share, "stats": dataclasses.asdict(backend.stats()),
            "blocks": len(backend.layouts),
        }
    outcome["equal_after_disable"] = torch.equal(forward(model, inputs), expected)
    return outcome


class RankOrderedDiT(nn.Module):
    """Runs its two stacks in an order that depends on the rank: a forward that is not the same
    on every rank, which DLO cannot keep in step."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
        self.second = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stacks = [self.first, self.second]
        if dist.get_rank() % 2:
            stacks.reverse()
        for block in [*stacks[0], *stacks[1]]:
            x = block(x)
        return x


def _order_mismatch(group: dist.ProcessGroup, world: int) -> str:
    torch.manual_seed(0)
    model = RankOrderedDiT()
    backend = DistributedLayerwiseOffloadBackend(
        model, settings=offload_settings(dp=world), device="cpu", group=group)
    with backend:
        try:
            with torch.no_grad():
                model(torch.ones(1, 8))
        except OffloadError as exc:
            return str(exc)
    return "no error"


def main(rank: int, world: int, port: int, out_dir: str) -> None:
    in_gloo_rank(rank, world, port, out_dir, _outcomes)


def _outcomes(world: int, group: dist.ProcessGroup) -> dict[str, Any]:
    outcomes: dict[str, Any] = {}
    for name in sorted(STACK_MODELS):
        reference = stack_model(name)
        outcomes[name] = _case(stack_model(name), reference,
                               stack_inputs(name, reference), group, world)
    for kind in KINDS:
        reference = tiny_model(kind)
        outcomes[kind] = _case(tiny_model(kind), reference,
                               example_inputs(kind, reference), group, world)
    outcomes["order-mismatch"] = _order_mismatch(group, world)
    return outcomes
