"""What `disable` undoes: the hooks, the tensors left in a slot, and, when asked, the model's own
storage.

Owns `tear_down`, the device-side half of `backend.disable` (after the lockstep check, before the
backend drops its references and a mapped plan's mappings close), `restore_streamed`, which
copies every streamed block back into tensors of its own, and `mark_disabled`, which leaves the
DiT marked as resident again or as released. Called by `backend.disable` alone; it must not
issue a collective except through the scheduler's loads of a restore (all ranks restore
together) and must not release host sources.
"""

from __future__ import annotations

from torch import nn

from dlo_runtime.forward_gate import refuse_released
from dlo_runtime.installed_hooks import InstalledHooks
from dlo_runtime.layout import BlockLayout
from dlo_runtime.misuse import MARK_ATTRIBUTE, OffloadMark
from dlo_runtime.on_demand import OnDemandModules
from dlo_runtime.slots import DeviceSlots
from dlo_runtime.streams import StreamSet
from dlo_runtime.tensors import ModelTensors, restore_device


def tear_down(hooks: InstalledHooks, on_demand: OnDemandModules, tensors: ModelTensors,
              layouts: list[BlockLayout], slots: DeviceSlots, streams: StreamSet, *,
              restore: bool) -> None:
    """Wait for the device, remove the hooks, give back the tensors a raised forward left in a
    slot and, with `restore`, every tensor's own storage on its own device."""
    # Outstanding transfers and kernels still read the slots and host sources.
    streams.synchronize()
    hooks.detach()
    on_demand.detach()
    # A forward that raised inside a streamed block left its tensors in a slot; with their
    # placeholders back, dropping the slots afterwards frees them whatever `restore` says.
    hooks.scheduler.release_in_use()
    if restore:
        restore_streamed(hooks, tensors, layouts, slots, streams)
        on_demand.restore()


def restore_streamed(hooks: InstalledHooks, tensors: ModelTensors, layouts: list[BlockLayout],
                     slots: DeviceSlots, streams: StreamSet) -> None:
    """Load each streamed block into the first slot and copy it out to its tensors' own devices;
    then the resident tensors go back where they were before `enable`."""
    scheduler = hooks.scheduler
    slot = slots[0]
    for index in range(len(layouts)):
        slots.clear()
        scheduler.load(index, slot)
        streams.synchronize()
        owned = tensors.streamed_tensors[index]
        for tensor, view, device in zip(
            owned, scheduler.slot_views[0][index], tensors.streamed_devices[index]
        ):
            tensor.data = view.to(restore_device(device), copy=True)
        # free: on the device these copies run on the compute stream; the next load into
        # the slot must not overwrite it while they still read it.
        slot.free.record(streams.compute())
    tensors.restore_resident()


def mark_disabled(dit: nn.Module, *, restore: bool) -> None:
    """Restored: the DiT is an ordinary model again. Not restored: its forwards are refused by
    name (`dlo_runtime.forward_gate.refuse_released`) instead of failing on a placeholder."""
    if restore:
        delattr(dit, MARK_ATTRIBUTE)
    else:
        setattr(dit, MARK_ATTRIBUTE, OffloadMark.RELEASED)
        refuse_released(dit)
