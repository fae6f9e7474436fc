"""Body of each gloo process started by `test_backend_lockstep.py`: ranks of one DLO AllGather
group that run different numbers of forwards.

Each case makes its own group with a one-hour timeout and (but the last, which times out on
purpose) waits an hour at the forward check (`offload.group_wait_timeout_s`), so only the check's
comparison can end a case before the test's own timeout: a rank that hung in a collective would
fail the test, not pass it. Every outcome is the message of the `OffloadError` a call raised (or
"ok"), written as JSON for the test to read.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from support.gloo_world import in_gloo_rank
from support.runtime_helpers import forward

from dlo_bench.models import example_inputs, tiny_model
from dlo_contract.settings import OffloadConfig, ParallelConfig, Settings
from dlo_runtime.backend import DistributedLayerwiseOffloadBackend
from dlo_runtime.tensors import OffloadError

HOUR = datetime.timedelta(hours=1)
STEPS = 2
"""Forwards every rank runs before the ranks part."""


@dataclass
class _Case:
    """One case's own group, and a Flux DiT offloaded over it that ran `STEPS` forwards."""

    group: dist.ProcessGroup
    model: torch.nn.Module
    inputs: dict[str, Any]
    backend: DistributedLayerwiseOffloadBackend
    equal: list[bool]
    """Whether each of the `STEPS` forwards equals the resident model's output."""

    @classmethod
    def start(cls, world: int, *, wait_s: float = HOUR.total_seconds()) -> _Case:
        group = dist.new_group(list(range(world)), timeout=HOUR)
        model = tiny_model("flux")
        inputs = example_inputs("flux", model)
        settings = Settings(offload=OffloadConfig(group_wait_timeout_s=wait_s),
                            parallel=ParallelConfig(dp=world))
        backend = DistributedLayerwiseOffloadBackend(model, settings=settings, device="cpu",
                                                     group=group).enable()
        # The forwards every rank runs wait as long as a loaded machine needs; the setting's
        # bound (`wait_s`) holds from the case's own calls on.
        lockstep = backend._lockstep
        assert lockstep is not None and lockstep.timeout_s == wait_s
        lockstep.timeout_s = HOUR.total_seconds()
        equal = [torch.equal(forward(model, inputs), forward(tiny_model("flux"), inputs))
                 for _ in range(STEPS)]
        lockstep.timeout_s = wait_s
        return cls(group, model, inputs, backend, equal)

    def forward(self) -> str:
        return _outcome(lambda: forward(self.model, self.inputs))

    def disable(self, *, restore: bool) -> str:
        return _outcome(lambda: self.backend.disable(restore=restore))

    def end(self) -> None:
        dist.destroy_process_group(self.group)


def _outcome(call: Callable[[], Any]) -> str:
    try:
        call()
    except OffloadError as exc:
        return str(exc)
    return "ok"


def _drift_case(world: int, rank: int, *, restore: bool) -> dict[str, Any]:
    """Every rank runs `STEPS` forwards; rank 0 then starts one more while the others disable
    (with `restore`); then rank 0 disables too, and every rank calls its DiT once more."""
    case = _Case.start(world)
    outcome: dict[str, Any] = {"equal": case.equal}
    if rank == 0:
        outcome["extra_forward"] = case.forward()
        outcome["forward_again"] = case.forward()
    outcome["disable"] = case.disable(restore=restore)
    outcome["disable_again"] = case.disable(restore=restore)
    outcome["call_after_disable"] = case.forward()
    case.end()
    return outcome


def _unanswered_case(world: int, rank: int) -> dict[str, Any]:
    """Rank 0 starts one forward more while rank 1 waits elsewhere (a barrier of the default
    group) for longer than rank 0's `offload.group_wait_timeout_s` of one second: rank 0 fails
    naming its forward; then both disable without restore."""
    case = _Case.start(world, wait_s=1.0)
    outcome: dict[str, Any] = {}
    if rank == 0:
        outcome["extra_forward"] = case.forward()
    dist.barrier()  # rank 1 is here until rank 0's extra forward has failed
    outcome["disable"] = case.disable(restore=False)
    dist.barrier()  # rank 0 keeps the group until rank 1's disable has returned
    case.end()
    return outcome


def _left_case(world: int, rank: int) -> dict[str, Any]:
    """Rank 1 leaves the group (destroys it, as a process that died would close it) after the
    forwards every rank ran; rank 0 then starts one more."""
    case = _Case.start(world)
    outcome: dict[str, Any] = {}
    if rank == 0:
        outcome["extra_forward"] = case.forward()
        outcome["disable"] = case.disable(restore=False)
    case.end()
    return outcome


def _in_step_case(world: int) -> dict[str, Any]:
    """Every rank runs the same forwards (one more after `STEPS`) and disables with restore: no
    error, and the model runs resident again."""
    case = _Case.start(world)
    case.forward()
    outcome = {"disable": case.disable(restore=True),
               "equal_after_disable": torch.equal(forward(case.model, case.inputs),
                                                  forward(tiny_model("flux"), case.inputs))}
    case.end()
    return outcome


def main(rank: int, world: int, port: int, out_dir: str) -> None:
    in_gloo_rank(rank, world, port, out_dir, _cases)


def _cases(world: int, group: dist.ProcessGroup) -> dict[str, Any]:
    rank = dist.get_rank()
    return {
        "in-step": _in_step_case(world),
        "drift-close": _drift_case(world, rank, restore=False),
        "drift-restore": _drift_case(world, rank, restore=True),
        "unanswered": _unanswered_case(world, rank),
        "left": _left_case(world, rank),
    }
