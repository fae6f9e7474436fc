"""Whether every rank of a DLO AllGather group is at the same forward, checked as each starts.

Owns `GroupLockstep`: the forward count of one backend in AllGather mode, and the one small
collective that compares it across the group before each forward and before disable. Called by
the backend (a forward pre-hook on the DiT, after `dlo_runtime.forward_gate` admitted the forward,
and `disable`); it must not touch slots, tensors or the block order, and issues no collective once
the group drifted.

[Note: lockstep] Every load of a streamed block is a collective over the server's group ([Note:
collective order] in `dlo_runtime.hooks`), so a rank that runs one forward more than the others
(or starts one while they disable) issues collectives that the others never pair, or pair with
other ones: a hang until the group's own timeout (torch's default: 30 minutes), a raw gloo error,
or an abort inside gloo when the sizes differ. So the first collective of every forward and of
`disable`, on every rank, is one all-gather of two int64 per rank: what the rank is about to do
(`Phase`) and its forward count. The k-th exchange of each rank pairs with the k-th of the others
whatever they are about to do, and every rank gets the same table:
- equal rows: go on (the check adds one round trip per forward, no device work on a group that
  gathers on the host);
- any difference: each rank raises the same `OffloadError` naming every rank's phase and count;
- no answer within `offload.group_wait_timeout_s`, or a rank left the group: this rank raises
  `OffloadError` naming the forward it waited at, and which of the two (the transport's own text
  stays in the chained cause).
After either the lockstep is `DRIFTED`: no collective goes over the group any more from this
backend (a later forward raises the same error, `disable` tears down this rank's side only), so
the ranks end with an error each instead of a hang or an abort. On a group that gathers on the
device (NCCL only), reading the table waits for the device's queued work, and a collective left
unanswered stays queued until the group's own timeout ends it.
"""

from __future__ import annotations

import datetime
import enum
import logging
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from dlo_contract.field_names import Names
from dlo_runtime.compiled import outside_compiled_graphs
from dlo_runtime.errors import OffloadError

logger = logging.getLogger(__name__)


class Phase(enum.IntEnum):
    """What a rank is about to do when it posts its forward count."""

    FORWARD = 1
    """Start forward number `count` (1 for the first after enable)."""
    DISABLE = 2
    """Disable after `count` forwards."""


class LockstepState(enum.Enum):
    IN_STEP = "in step"
    """Every exchange so far agreed: the group's collectives pair."""
    DRIFTED = "drifted"
    """An exchange disagreed or got no answer: nothing goes over the group any more."""


class GroupLockstep:
    """The forward count of one AllGather backend, compared across its group; see [Note:
    lockstep]."""

    def __init__(self, group: dist.ProcessGroup, *, rank: int, device: torch.device, model: str,
                 timeout_s: float, names: Names) -> None:
        self.group = group
        self.rank = rank
        self.model = model
        """The DiT's class name, for messages."""
        self.timeout_s = timeout_s
        self.names = names
        self.forwards = 0
        """Forwards started since enable (the one in flight included)."""
        self.state = LockstepState.IN_STEP
        self._drift: OffloadError | None = None
        """The error every later forward of a drifted group raises again."""
        self._device = _exchange_device(group, device)
        self._handle: RemovableHandle | None = None

    def attach(self, dit: nn.Module) -> None:
        """Check before each forward of `dit`: a pre-hook that runs after the forward gate's
        (which is prepended), so a refused or waiting forward posts nothing."""
        self._handle = dit.register_forward_pre_hook(self._pre_forward)

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    @outside_compiled_graphs
    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        self.start_forward()

    def start_forward(self) -> None:
        """Before the forward's first load: raise `OffloadError` unless every rank starts the
        same forward now."""
        if self._drift is not None:
            raise OffloadError(str(self._drift), hint=self._drift.hint)
        self.forwards += 1
        self._exchange(Phase.FORWARD)

    @property
    def in_step(self) -> bool:
        return self.state is LockstepState.IN_STEP

    def start_disable(self, *, restore: bool) -> OffloadError | None:
        """Before disable's collectives: None when every rank disables after the same forward
        (its gathers may run). Else the group drifted, and this is what disable raises once it
        has torn down this rank's side without a collective: the drift this check found; or,
        when a forward found it already, that the model was not restored (nothing when
        `restore` is False: the forward raised the drift then)."""
        if self._drift is None:
            try:
                self._exchange(Phase.DISABLE)
                return None
            except OffloadError as drift:
                return drift
        logger.warning("dlo: disabling %s on rank %d alone: its DLO group drifted at forward %d",
                       self.model, self.rank, self.forwards)
        if not restore:
            return None
        return OffloadError(
            f"{self.model} was not restored: its DLO group drifted at forward {self.forwards}, "
            "so its blocks cannot be gathered; its streamed tensors are empty placeholders",
            hint="load the model again; see the error that forward raised on each rank")

    def _exchange(self, phase: Phase) -> None:
        mine = torch.tensor([int(phase), self.forwards], dtype=torch.int64, device=self._device)
        table = torch.empty(2 * dist.get_world_size(self.group), dtype=torch.int64,
                            device=self._device)
        started = time.monotonic()
        try:
            work = dist.all_gather_single(table, mine, group=self.group, async_op=True)
            # Bounded here, not by the group's own timeout (see [Note: lockstep]).
            work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
            rows = table.view(-1, 2).tolist()
        except (RuntimeError, dist.DistError) as exc:
            timed_out = time.monotonic() - started >= self.timeout_s
            self._drifted(self._unanswered(phase, timed_out))
            raise self._drift from exc  # type: ignore[misc]
        if any(row != rows[0] for row in rows):
            self._drifted(self._disagreement(rows))
            raise self._drift  # type: ignore[misc]

    def _drifted(self, error: OffloadError) -> None:
        self.state = LockstepState.DRIFTED
        self._drift = error

    def _disagreement(self, rows: list[list[int]]) -> OffloadError:
        where = ", ".join(f"rank {rank} {_doing(Phase(phase), count)}"
                          for rank, (phase, count) in enumerate(rows))
        return OffloadError(
            f"the ranks of the DLO group of {self.model} are not at the same forward: {where}; "
            "their AllGather loads would go out of step",
            hint="run the same forwards on every rank of the group (the same steps for every "
            "request) and disable on every rank after the same one; this group streams no more "
            "forwards: disable DLO on every rank",
        )

    def _unanswered(self, phase: Phase, timed_out: bool) -> OffloadError:
        """The collective failed: no answer in time, or the transport lost a rank (the
        transport's own text, with its ports and source paths, stays in the chained cause)."""
        timeout = self.names("offload.group_wait_timeout_s")
        what = (f"the other ranks did not answer within {self.timeout_s:g} s ({timeout})"
                if timed_out else "the check's collective failed (a rank stopped or left the "
                "group, or the group's own timeout ran out)")
        return OffloadError(
            f"rank {self.rank} of the DLO group of {self.model} {_doing(phase, self.forwards)} "
            f"but {what}",
            hint="every rank of the group must run the same forwards and disable together; see "
            f"the other ranks' logs (a rank that stopped stops the group), or raise {timeout} "
            "when a rank is only slower",
        )


def _doing(phase: Phase, count: int) -> str:
    if phase is Phase.FORWARD:
        return f"starts forward {count}"
    return f"disables after {count} forward{'' if count == 1 else 's'}"


def _exchange_device(group: dist.ProcessGroup, device: torch.device) -> torch.device:
    """The host when the group gathers host tensors (gloo, or a `cpu:gloo,cuda:nccl` group);
    else the backend's `device`, where the group gathers the blocks (an NCCL-only group gathers
    device tensors only)."""
    return torch.device("cpu") if "gloo" in str(dist.get_backend(group)) else device
