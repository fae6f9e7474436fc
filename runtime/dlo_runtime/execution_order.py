"""The order the forward runs the streamed blocks in, and the DiT-level hooks that mark a step.

Owns `ExecutionOrder`: which streamed block the scheduler prefetches after which. A declared or
built-in plan lists its blocks in execution order, so the order is fixed at enable. A heuristic
plan only knows which lists hold blocks, not how the forward interleaves them (a dual-stream list
then a single-stream one, a spatial block then a temporal one, hint blocks before the main
ones), so the order is learned from the first forward, as diffusers' group offloading learns it:
the blocks are recorded as they run, and when the forward returns the order becomes the run order
(blocks that did not run keep their declaration order, after the others). Until then a block that
was not prefetched is loaded when it runs, which costs a wait, never a wrong result.

[Note: learned order] In AllGather mode every load is a collective (see [Note: collective
order] in `dlo_runtime.hooks`). Ranks running the same forward observe the same order, so their
loads stay in step during and after learning. While learning, a rank that runs another block
than the others would issue other loads (a collective mismatch, or a hang), so before each block
first runs the ranks compare which block it is, and a difference stops every rank with an error
naming both blocks. After the first forward the order is the same on every rank by construction.

Owns `StepHooks` too: one forward hook on the DiT itself, which tells the order and the run
statistics where a forward ends. Called by the backend (built once), `installed_hooks` (attach,
detach) and by the hook scheduler (`observe`, `next_after`); it must not issue transfers.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from dlo_runtime.tensors import OffloadError


class OrderState(enum.Enum):
    """Where the prefetch order of the streamed blocks comes from."""

    LEARNING = "learning"
    """Heuristic plan before its first forward ended: blocks are recorded as they run."""
    FIXED = "fixed"
    """From the plan, or learned: `next_after` follows it."""


class ExecutionOrder:
    """The streamed blocks' run order, by their position in the discovered plan."""

    def __init__(
        self, count: int, *, learn: bool, paths: list[str], group: dist.ProcessGroup | None
    ) -> None:
        self.count = count
        self.paths = paths
        self.group = group
        self.state = OrderState.LEARNING if learn else OrderState.FIXED
        self.sequence: list[int] = list(range(count))
        """Positions in the order the forward runs them (the plan's order until learned)."""
        self._following = [(position + 1) % count for position in range(count)]
        self._seen: dict[int, None] = {}

    @property
    def first(self) -> int:
        return self.sequence[0]

    def next_after(self, position: int) -> int:
        """The block to prefetch while `position` runs: the next in the order, wrapping round
        to the first (the next forward's) after the last."""
        return self._following[position]

    def observe(self, position: int) -> None:
        """A block is about to run (recorded only while learning)."""
        if self.state is OrderState.LEARNING and position not in self._seen:
            self._check_ranks_agree(position)
            self._seen[position] = None

    def step_end(self) -> None:
        """The DiT's forward returned: a learning order becomes the order blocks ran in."""
        if self.state is not OrderState.LEARNING or not self._seen:
            return
        ran = list(self._seen)
        self.sequence = ran + [p for p in range(self.count) if p not in self._seen]
        self._following = [0] * self.count
        for here, there in zip(self.sequence, self.sequence[1:] + self.sequence[:1]):
            self._following[here] = there
        self.state = OrderState.FIXED
        self._seen = {}

    def _check_ranks_agree(self, position: int) -> None:
        """See [Note: learned order]: before a block first runs, and before it can be loaded,
        every rank says which block it is about to run (one small collective per block, in the
        first forward only)."""
        if self.group is None:
            return
        positions: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(positions, position, group=self.group)
        for rank, there in enumerate(positions):
            if there != position:
                raise OffloadError(
                    f"rank {rank} of the DLO group runs {self.paths[there]} where this rank "
                    f"runs {self.paths[position]} (block {len(self._seen) + 1} of the first "
                    "forward); AllGather loads would go out of step",
                    hint="run the same forward on every rank of the group, or declare the "
                    "block order with _dlo_offload_plan",
                )

    def run_order(self) -> list[str]:
        """Paths of the streamed blocks in the order they are prefetched."""
        return [self.paths[position] for position in self.sequence]


class StepHooks:
    """Calls `on_end()` after every forward of the DiT that returns."""

    def __init__(self, on_end: Callable[[], None]) -> None:
        self._on_end = on_end
        self._handles: list[RemovableHandle] = []

    def attach(self, dit: nn.Module) -> None:
        self._handles = [dit.register_forward_hook(lambda module, args, output: self._on_end())]

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
