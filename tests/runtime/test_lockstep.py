"""The lockstep check's parts that need no second process: where the exchange's tensors live for
each kind of group, how a disagreement is worded for any number of ranks, and a group of one
that always agrees (the two-process cases are `test_backend_lockstep.py`'s)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from dlo_contract.field_names import document_names
from dlo_runtime import lockstep
from dlo_runtime.lockstep import GroupLockstep, LockstepState


@pytest.fixture
def world_of_one() -> Iterator[dist.ProcessGroup]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _lockstep(group: dist.ProcessGroup, device: str = "cpu") -> GroupLockstep:
    return GroupLockstep(group, rank=0, device=torch.device(device), model="WanTransformer3DModel",
                         timeout_s=5.0, names=document_names)


@pytest.mark.parametrize(("backend", "device"), [
    ("gloo", "cpu"), ("cpu:gloo,cuda:nccl", "cpu"), ("nccl", "cuda:1"),
])
def test_the_exchange_gathers_on_the_host_unless_the_group_has_no_gloo(
    world_of_one: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch, backend: str, device: str,
) -> None:
    """An NCCL-only group gathers device tensors, on the backend's device (the rank's own GPU,
    not the current one); any group with gloo gathers two host integers, with no device work."""
    monkeypatch.setattr(lockstep.dist, "get_backend", lambda group: backend)
    assert _lockstep(world_of_one, device="cuda:1")._device == torch.device(device)


def test_a_group_of_one_always_agrees(world_of_one: dist.ProcessGroup) -> None:
    check = _lockstep(world_of_one)
    check.start_forward()
    check.start_forward()
    assert check.start_disable(restore=True) is None
    assert (check.forwards, check.state) == (2, LockstepState.IN_STEP)


def test_a_disagreement_names_every_rank_and_what_it_does(
    world_of_one: dist.ProcessGroup,
) -> None:
    error = _lockstep(world_of_one)._disagreement([[1, 5], [2, 1], [1, 4]])
    assert str(error) == (
        "the ranks of the DLO group of WanTransformer3DModel are not at the same forward: rank 0 "
        "starts forward 5, rank 1 disables after 1 forward, rank 2 starts forward 4; their "
        "AllGather loads would go out of step")
    assert error.hint == (
        "run the same forwards on every rank of the group (the same steps for every request) "
        "and disable on every rank after the same one; this group streams no more forwards: "
        "disable DLO on every rank")
