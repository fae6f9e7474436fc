"""The forward hooks of one enabled DiT: what runs each forward's prefetch and compute.

Owns `InstalledHooks`, the typed record of everything `enable` attaches to the DiT and its
streamed blocks, and `install_hooks`, which builds the run order (`dlo_runtime.execution_order`),
the statistics recorder (`dlo_runtime.run_stats`) and the one `BlockScheduler` all block hooks
share (`dlo_runtime.hooks`), then attaches, in this order, the step hook, the forward gate
(`dlo_runtime.forward_gate`), in AllGather mode the lockstep check (`dlo_runtime.lockstep`), and one
hook per streamed block. `InstalledHooks.detach` removes them all. Called by `backend.enable` and
`dlo_runtime.teardown`; it must not place tensors, build slots or release host sources.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from dlo_contract.field_names import Names
from dlo_contract.settings import Settings
from dlo_runtime.execution_order import ExecutionOrder, StepHooks
from dlo_runtime.forward_gate import ForwardGate
from dlo_runtime.hooks import BlockScheduler, DistributedLayerwiseOffloadHook
from dlo_runtime.lockstep import GroupLockstep
from dlo_runtime.offload_setup import OffloadSetup
from dlo_runtime.run_stats import StatsRecorder, load_bytes
from dlo_runtime.streams import StreamSet


@dataclass(frozen=True)
class InstalledHooks:
    """The hooks on one DiT while it is enabled, and the state they share."""

    order: ExecutionOrder
    recorder: StatsRecorder
    scheduler: BlockScheduler
    step_hooks: StepHooks
    forward_gate: ForwardGate
    lockstep: GroupLockstep | None
    """AllGather mode: the forward count compared across the group (see [Note: lockstep])."""
    blocks: list[DistributedLayerwiseOffloadHook]
    """One hook per streamed block, in the order of `setup.model.streamed`."""

    def detach(self) -> None:
        """Remove every hook from the DiT and its blocks; the shared state stays readable."""
        for hook in self.blocks:
            hook.detach()
        self.step_hooks.detach()
        self.forward_gate.detach()
        if self.lockstep is not None:
            self.lockstep.detach()


def install_hooks(dit: nn.Module, setup: OffloadSetup, *, streams: StreamSet,
                  step_hooks: StepHooks, forward_gate: ForwardGate, settings: Settings,
                  names: Names, group: dist.ProcessGroup | None, rank: int,
                  device: torch.device) -> InstalledHooks:
    """One hook per streamed block, all sharing one scheduler, and the DiT's own hooks."""
    model, source = setup.model, setup.feed.source
    paths = [block.path for block in model.streamed]
    order = ExecutionOrder(
        len(paths), learn=model.plan.source == "heuristic", paths=paths, group=group
    )
    h2d, gathered = load_bytes(setup.layouts, source)
    recorder = StatsRecorder(streams, h2d_bytes=h2d, gathered_bytes=gathered)
    scheduler = BlockScheduler(
        tensors=setup.tensors.streamed_tensors,
        placeholders=setup.tensors.placeholders,
        slot_views=setup.feed.slot_views,
        slots=setup.feed.slots,
        source=source,
        streams=streams,
        order=order,
        stats=recorder,
    )
    step_hooks.attach(dit)
    # After the step hook, so that the step end is recorded before the next forward enters.
    forward_gate.attach(dit)
    lockstep = None
    if group is not None:
        lockstep = GroupLockstep(
            group, rank=rank, device=device, model=type(dit).__name__,
            timeout_s=settings.offload.group_wait_timeout_s, names=names)
        lockstep.attach(dit)
    blocks = []
    for position, block in enumerate(model.streamed):
        hook = DistributedLayerwiseOffloadHook(position, scheduler)
        hook.attach(block.module)
        blocks.append(hook)
    return InstalledHooks(order=order, recorder=recorder, scheduler=scheduler,
                          step_hooks=step_hooks, forward_gate=forward_gate, lockstep=lockstep,
                          blocks=blocks)
