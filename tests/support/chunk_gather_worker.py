"""A gloo rank for the loader group's chunk all-gather (`tests/loader/test_loader_transport.py`):
two all-gathers in flight at once, each rank's chunk of each a byte pattern of its own, and
torch's own all-gather forbidden on the CPU path (it gathered into a new flat tensor every
round: see [Note: sends into the slots] in `dlo_loader.transport`)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from dlo_loader.fetch import chunk_buffer
from dlo_loader.transport import Group

from support.gloo_world import in_gloo_rank

WIDTH = 3 * 4096 + 5
"""A slot's length in the test: pages and an odd tail, as a round's last chunk has."""
ROUNDS = 3


def pattern(rank: int, round_number: int) -> bytes:
    return bytes([(rank * 16 + round_number) % 251]) * WIDTH


def _cases(world: int, group: dist.ProcessGroup) -> dict[str, Any]:
    def forbidden(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("all_gather_into_tensor gathers into a flat tensor of its own")

    dist.all_gather_into_tensor = forbidden
    rank = dist.get_rank()
    loader_group = Group(rank=rank, world_size=world, backend="gloo", store=None, timeout_s=60)
    sends = [chunk_buffer(WIDTH) for _ in range(ROUNDS)]
    receives = [chunk_buffer(world * WIDTH) for _ in range(ROUNDS)]
    waits = []
    for number in range(ROUNDS):  # every round posted before the first is waited for
        sends[number][:] = pattern(rank, number)
        waits.append(loader_group.all_gather_into(memoryview(sends[number]),
                                                  memoryview(receives[number])))
    for wait in waits:
        wait()
    return {"slots": [[receives[number][r * WIDTH:(r + 1) * WIDTH] == pattern(r, number)
                       for r in range(world)] for number in range(ROUNDS)]}


def main(rank: int, world: int, port: int, out_dir: str) -> None:
    in_gloo_rank(rank, world, port, out_dir, _cases)
