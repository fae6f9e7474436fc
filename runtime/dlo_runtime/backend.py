"""Distributed Layerwise Offload of one DiT: setup, hooks and teardown.

Owns `DistributedLayerwiseOffloadBackend`, the resource owner of DLO in one process: it validates
the settings, discovers the blocks, consumes the host weight plan (or the module's own tensors),
selects the existing DP/SP group, builds the host shards or sources, allocates the two device
slots, moves the non-block parts to the device (except the on-demand modules, whose host copies
`dlo_runtime.on_demand` keeps), installs one hook per streamed block and primes the first
transfer. `disable` undoes all of it. Called by the inference server at startup and
shutdown (before it destroys its process groups); it never creates a process group and never
re-runs the loader's checks. Tensor bookkeeping lives in `dlo_runtime.tensors`.

    backend = DistributedLayerwiseOffloadBackend(
        pipeline.transformer, settings=load_settings(), device="cuda:0",
        group=dp_group, host_plan=loader.take_host_weight_plan(),
    )
    with backend:          # enable(); disable() at exit, before the process groups go
        pipeline(prompt)
"""

from __future__ import annotations

import gc
import logging
from typing import Any, Protocol

import torch
import torch.distributed as dist

from dlo_runtime.discovery import DiscoveredModel, ModuleDiscovery
from dlo_runtime.execution_order import ExecutionOrder, OrderState, StepHooks
from dlo_runtime.forward_gate import ForwardGate, refuse_released
from dlo_runtime.hooks import BlockScheduler, DistributedLayerwiseOffloadHook
from dlo_runtime.layout import BlockLayout
from dlo_runtime.lockstep import GroupLockstep
from dlo_runtime.misuse import MARK_ATTRIBUTE, OffloadMark, refuse_misuse
from dlo_runtime.offload_plan import weight_bytes
from dlo_runtime.run_stats import OffloadStats, StatsRecorder, load_bytes
from dlo_runtime.on_demand import OnDemandModules
from dlo_runtime.placement import Placement, resolve_placement
from dlo_contract.settings import Settings, SettingsError
from dlo_runtime.slots import DeviceSlots
from dlo_runtime.streams import HostMemory, StreamSet
from dlo_runtime.tensors import ModelTensors, OffloadError, restore_device
from dlo_runtime.slot_feed import HostSource, SourceKind, build_feed, source_kind
from dlo_contract.field_names import Names
from dlo_contract.validation import names_for, validate

logger = logging.getLogger(__name__)


class HostPlan(Protocol):
    """The part of `dlo_runtime.host_weight_plan.HostWeightPlan` the backend uses."""

    backing_kind: Any
    sources_pinned: bool

    def take_tensors(self) -> dict[str, torch.Tensor]: ...

    def release_sources(self) -> None: ...


class DistributedLayerwiseOffloadBackend:
    """Streams the DiT blocks of `dit` through two device slots while enabled.

    In AllGather mode (a DLO group of G > 1 ranks) every rank must call `enable`, run the same
    forwards and call `disable` together: each of them issues collectives over `group`, and
    each forward and `disable` first checks that every rank is at the same one
    (`dlo_runtime.lockstep`). Forwards run one at a time (`dlo_runtime.forward_gate`).
    """

    def __init__(
        self,
        dit: object,
        *,
        settings: Settings,
        device: torch.device | str,
        group: dist.ProcessGroup | None = None,
        host_plan: HostPlan | None = None,
        placement: Placement | None = None,
        streams: StreamSet | None = None,
        host_memory: HostMemory | None = None,
        names: Names | None = None,
    ) -> None:
        """`host_memory` allocates the host arenas of the default `StreamSet` (a `streams`
        passed in brings its own): page-locked at their exact size on CUDA
        (`dlo_runtime.pinned_arena`), pageable on the CPU. `names` spells the settings in
        messages (`pod.enable` hands down its namer)."""
        # A placement comes from `pod.enable`, which validated the settings, resolved the namer
        # and the group once for the whole process; a backend built directly decides all three.
        self.settings = settings if placement is not None else validate(settings)
        self.names = names or names_for(self.settings)
        if not self.settings.offload.enabled:
            name = self.names("offload.enabled")
            raise SettingsError(
                f"{name}=false: the DLO backend would have nothing to do",
                hint=f"keep the model resident (pod.enable does so when {name} is false), or "
                f"set {name}=true",
            )
        self.device = torch.device(device)
        self.discovery = ModuleDiscovery(dit)
        self.dit = self.discovery.dit
        self.placement = placement or resolve_placement(self.settings, names=self.names,
                                                        group=group)
        self.group, self.rank = self.placement.group, self.placement.rank
        self.shard_count = self.placement.shard_count
        self.host_plan = host_plan
        self.enabled = False
        self.layouts: list[BlockLayout] = []
        self.slots: DeviceSlots | None = None
        self._source: HostSource | None = None
        self._scheduler: BlockScheduler | None = None
        self._hooks: list[DistributedLayerwiseOffloadHook] = []
        self._tensors: ModelTensors | None = None
        self._on_demand: OnDemandModules | None = None
        self._mapped_plan: HostPlan | None = None
        self._streams = streams if streams is not None else StreamSet(self.device, host_memory)
        """The copy/communication streams and events of `device` (see `dlo_runtime.streams`)."""
        self._order: ExecutionOrder | None = None
        self._recorder: StatsRecorder | None = None
        self._step_hooks = StepHooks(self._step_end)
        self._forward_gate = ForwardGate(type(self.dit).__name__)
        self._lockstep: GroupLockstep | None = None
        """AllGather mode: the forward count compared across the group (see [Note: lockstep])."""
        self.streamed_share = 0.0
        """Share of the DiT's weight bytes (parameters and persistent buffers) that streams
        through the slots, set by `enable`; the rest stays resident or comes in on demand."""

    @property
    def mode(self) -> str:
        return self.placement.mode

    def enable(self) -> DistributedLayerwiseOffloadBackend:
        """Shard or map the streamed blocks, move the rest to the device and install hooks."""
        if self.enabled:
            raise OffloadError("DLO is already enabled on this model", hint="call disable() first")
        refuse_misuse(self.dit, host_plan=self.host_plan is not None)
        model = self.discovery.discover(self.settings.offload.resident_layers, self.names)
        total_bytes = weight_bytes(self.dit)
        held_weights = any(not p.is_meta for p in self.dit.parameters())
        tensors = ModelTensors(model)
        plan, self.host_plan = self.host_plan, None
        sources = tensors.sources(plan.take_tensors() if plan is not None else None)
        self.layouts = tensors.layouts(
            [block.path for block in model.streamed], tensors.streamed_names, sources,
            self.shard_count, self._streams.align_bytes,
        )
        kind = source_kind(plan, grouped=self.group is not None, streams=self._streams)
        feed = build_feed(kind, self.layouts, sources, self._streams, group=self.group,
                          rank=self.rank)
        self.slots, self._source = feed.slots, feed.source
        on_demand = self._place(model, tensors, sources, plan)
        del sources
        self._install_hooks(model, tensors, feed.slot_views)
        on_demand.attach([entry.module for entry in model.on_demand])
        self._tensors, self._on_demand = tensors, on_demand
        self.enabled = True
        setattr(self.dit, MARK_ATTRIBUTE, OffloadMark.ENABLED)
        self._scheduler.prime()
        if held_weights:
            # The replaced weights may sit in reference cycles. A weightless DiT frees nothing,
            # and a full collection with torch and diffusers loaded costs a cold start ~0.2 s.
            gc.collect()
        self.streamed_share = self.streamed_bytes / total_bytes if total_bytes else 0.0
        self._log_enabled(model, kind, total_bytes)
        return self

    def _place(self, model: DiscoveredModel, tensors: ModelTensors,
               sources: dict[str, torch.Tensor], plan: HostPlan | None) -> OnDemandModules:
        """Put every tensor where it lives while enabled: resident ones on the device, the
        on-demand modules' host copies in their arena, the streamed ones as placeholders; and
        release the plan's mappings once nothing reads them any more."""
        tensors.replace_meta()
        tensors.place_resident(sources, self.device)
        on_demand_layouts = tensors.layouts(
            [e.path for e in model.on_demand], tensors.on_demand_names, sources, 1,
            self._streams.align_bytes,
        )
        on_demand = OnDemandModules(
            on_demand_layouts, tensors.on_demand_tensors, sources, self._streams
        )
        self._mapped_plan = None if plan is None or self.group is not None else plan
        if plan is not None and self.group is not None:
            # Shards, resident and on-demand copies are made: the mappings are no longer read.
            plan.release_sources()
        tensors.place_streamed_placeholders(
            self.device, [[e.meta.dtype for e in layout.entries] for layout in self.layouts]
        )
        return on_demand

    def _log_enabled(self, model: DiscoveredModel, kind: SourceKind, total_bytes: int) -> None:
        logger.info(
            "dlo: enabled on %s (%s plan, lists %s): %d streamed, %d resident blocks, "
            "%d on-demand modules, streamed share %.1f%% of %d weight bytes, mode %s over %d "
            "rank(s), %s source, device slots %d bytes", type(self.dit).__name__,
            model.plan.source, ",".join(model.plan.blocks), len(model.streamed),
            len(model.resident), len(model.on_demand), 100 * self.streamed_share, total_bytes,
            self.mode, self.shard_count, kind.value, self.slot_bytes,
        )

    def _step_end(self) -> None:
        """A forward of the DiT returned (see `StepHooks`)."""
        assert self._order is not None and self._recorder is not None
        self._recorder.step_end()
        if self._order.state is OrderState.LEARNING:
            self._order.step_end()
            logger.info("dlo: learned the run order of %s's streamed blocks from its first "
                        "forward: %s", type(self.dit).__name__, ",".join(self._order.run_order()))

    def stats(self) -> OffloadStats:
        """Blocks loaded, bytes copied and gathered, and time compute waited for a slot: over
        the last complete forward and since enable (see `dlo_runtime.run_stats`)."""
        if self._recorder is None:
            raise OffloadError("DLO is not enabled on this model", hint="call enable() first")
        return self._recorder.snapshot(streamed_blocks=len(self.layouts), mode=self.mode)

    def _install_hooks(
        self,
        model: DiscoveredModel,
        tensors: ModelTensors,
        slot_views: list[list[list[torch.Tensor]]],
    ) -> None:
        """One hook per streamed block, all sharing one scheduler."""
        assert self.slots is not None and self._source is not None
        paths = [block.path for block in model.streamed]
        self._order = ExecutionOrder(
            len(paths), learn=model.plan.source == "heuristic", paths=paths, group=self.group
        )
        h2d, gathered = load_bytes(self.layouts, self._source)
        self._recorder = StatsRecorder(self._streams, h2d_bytes=h2d, gathered_bytes=gathered)
        self._scheduler = BlockScheduler(
            tensors=tensors.streamed_tensors,
            placeholders=tensors.placeholders,
            slot_views=slot_views,
            slots=self.slots,
            source=self._source,
            streams=self._streams,
            order=self._order,
            stats=self._recorder,
        )
        self._step_hooks.attach(self.dit)
        # After the step hook, so that the step end is recorded before the next forward enters.
        self._forward_gate.attach(self.dit)
        if self.group is not None:
            self._lockstep = GroupLockstep(
                self.group, rank=self.rank, device=self.device, model=type(self.dit).__name__,
                timeout_s=self.settings.offload.group_wait_timeout_s, names=self.names)
            self._lockstep.attach(self.dit)
        self._hooks = []
        for position, block in enumerate(model.streamed):
            hook = DistributedLayerwiseOffloadHook(position, self._scheduler)
            hook.attach(block.module)
            self._hooks.append(hook)

    def disable(self, *, restore: bool = True) -> None:
        """Synchronize, remove hooks, release the slots and the host sources.

        With `restore` every tensor gets its own storage back on the device it had before
        `enable` (the model runs resident again and can be enabled again); in AllGather mode
        that gathers every block once, so all ranks must call it. `restore=False` is for
        shutdown: the streamed tensors stay empty placeholders (those of a block whose forward
        raised get theirs back), so no slot stays allocated, and a later forward of the DiT
        raises `OffloadError`.

        In AllGather mode every rank first checks that the others disable after the same forward
        ([Note: lockstep]). When the group drifted, this rank tears down alone without issuing a
        collective (its tensors stay placeholders, as with `restore=False`) and then raises
        `OffloadError`, unless a forward raised the drift already and `restore` is False.
        """
        if not self.enabled:
            return
        assert self._tensors is not None and self._scheduler is not None and self.slots
        assert self._on_demand is not None
        lockstep = self._lockstep
        drift = lockstep.start_disable(restore=restore) if lockstep is not None else None
        restore = restore and (lockstep is None or lockstep.in_step)
        # Outstanding transfers and kernels still read the slots and host sources.
        self._streams.synchronize()
        for hook in self._hooks:
            hook.detach()
        self._step_hooks.detach()
        self._forward_gate.detach()
        if self._lockstep is not None:
            self._lockstep.detach()
        self._on_demand.detach()
        # A forward that raised inside a streamed block left its tensors in a slot; with their
        # placeholders back, dropping the slots below frees them whatever `restore` says.
        self._scheduler.release_in_use()
        if restore:
            self._restore()
            self._on_demand.restore()
        self._hooks = []
        self._on_demand = None
        self._scheduler = None
        self._source = None
        self.slots = None
        self._tensors = None
        self._order = self._recorder = None
        self._lockstep = None
        self.enabled = False
        if restore:
            delattr(self.dit, MARK_ATTRIBUTE)
        else:
            setattr(self.dit, MARK_ATTRIBUTE, OffloadMark.RELEASED)
            refuse_released(self.dit)
        if self._mapped_plan is not None:
            # Mappings close only after the synchronize above: no copy reads them any more.
            self._mapped_plan.release_sources()
            self._mapped_plan = None
        gc.collect()
        logger.info("dlo: disabled on %s", type(self.dit).__name__)
        if drift is not None:
            raise drift

    def _restore(self) -> None:
        assert self._tensors is not None and self._scheduler is not None and self.slots
        slot = self.slots[0]
        for index in range(len(self.layouts)):
            self.slots.clear()
            self._scheduler.load(index, slot)
            self._streams.synchronize()
            owned = self._tensors.streamed_tensors[index]
            for tensor, view, device in zip(
                owned, self._scheduler.slot_views[0][index], self._tensors.streamed_devices[index]
            ):
                tensor.data = view.to(restore_device(device), copy=True)
            # free: on the device these copies run on the compute stream; the next load into
            # the slot must not overwrite it while they still read it.
            slot.free.record(self._streams.compute())
        self._tensors.restore_resident()

    def __enter__(self) -> DistributedLayerwiseOffloadBackend:
        return self.enable()

    def __exit__(self, *exc: object) -> None:
        self.disable()

    @property
    def slot_bytes(self) -> int:
        """Device bytes of the two slots."""
        return self.slots.nbytes if self.slots is not None else 0

    @property
    def streamed_bytes(self) -> int:
        """Bytes of the streamed blocks' tensors (without padding)."""
        return sum(layout.tensor_bytes for layout in self.layouts)

    @property
    def on_demand_bytes(self) -> int:
        """Bytes of the on-demand modules' tensors, held whole in host memory on every rank."""
        return self._on_demand.tensor_bytes if self._on_demand is not None else 0

    def host_tensors(self) -> list[torch.Tensor]:
        """The host tensors this backend holds: the streamed blocks' shards or sources, and the
        on-demand modules' arena."""
        if self._source is None or self._on_demand is None:
            return []
        return self._source.host_tensors() + self._on_demand.host_tensors()


def host_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one storage count once)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())

