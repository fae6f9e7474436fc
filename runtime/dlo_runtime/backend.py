"""Distributed Layerwise Offload of one DiT: setup, hooks and teardown.

Owns `DistributedLayerwiseOffloadBackend`, the resource owner of DLO in one process: it validates
the settings, selects the existing DP/SP group, discovers the blocks and runs the three phases
in order, each in a module of its own: `dlo_runtime.offload_setup` consumes the host weight plan
(or the module's own tensors), builds the host shards or sources and the two device slots and
moves the non-block parts to the device (except the on-demand modules, whose host copies
`dlo_runtime.on_demand` keeps); `dlo_runtime.installed_hooks` installs the forward hooks (one per
streamed block) before the backend primes the first transfer; `dlo_runtime.teardown` undoes it
all at `disable`. Called by the inference server at startup and shutdown (before it destroys its
process groups); it never creates a process group and never re-runs the loader's checks. Tensor
bookkeeping lives in `dlo_runtime.tensors`.

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

import torch
import torch.distributed as dist

from dlo_contract.field_names import Names
from dlo_contract.settings import Settings, SettingsError
from dlo_contract.validation import names_for, validate
from dlo_runtime.discovery import ModuleDiscovery
from dlo_runtime.execution_order import ExecutionOrder, OrderState, StepHooks
from dlo_runtime.forward_gate import ForwardGate
from dlo_runtime.hooks import BlockScheduler
from dlo_runtime.installed_hooks import InstalledHooks, install_hooks
from dlo_runtime.layout import BlockLayout
from dlo_runtime.lockstep import GroupLockstep
from dlo_runtime.misuse import MARK_ATTRIBUTE, OffloadMark, refuse_misuse
from dlo_runtime.offload_setup import HostPlan, OffloadSetup, build_setup
from dlo_runtime.on_demand import OnDemandModules
from dlo_runtime.placement import Placement, resolve_placement
from dlo_runtime.run_stats import OffloadStats, StatsRecorder
from dlo_runtime.slot_feed import HostSource
from dlo_runtime.slots import DeviceSlots
from dlo_runtime.streams import HostMemory, StreamSet
from dlo_runtime.teardown import mark_disabled, tear_down
from dlo_runtime.tensors import ModelTensors, OffloadError

__all__ = ["DistributedLayerwiseOffloadBackend", "HostPlan", "host_bytes"]

logger = logging.getLogger(__name__)


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
        self._installed: InstalledHooks | None = None
        """The forward hooks and the scheduler, order and recorder they share, while enabled."""
        self._tensors: ModelTensors | None = None
        self._on_demand: OnDemandModules | None = None
        self._mapped_plan: HostPlan | None = None
        self._streams = streams if streams is not None else StreamSet(self.device, host_memory)
        """The copy/communication streams and events of `device` (see `dlo_runtime.streams`)."""
        self._step_hooks = StepHooks(self._step_end)
        self._forward_gate = ForwardGate(type(self.dit).__name__)
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
        plan, self.host_plan = self.host_plan, None
        setup = build_setup(self.dit, model, plan, streams=self._streams, device=self.device,
                            group=self.group, rank=self.rank, shard_count=self.shard_count)
        self.layouts, self._mapped_plan = setup.layouts, setup.mapped_plan
        self.slots, self._source = setup.feed.slots, setup.feed.source
        self._installed = install_hooks(
            self.dit, setup, streams=self._streams, step_hooks=self._step_hooks,
            forward_gate=self._forward_gate, settings=self.settings, names=self.names,
            group=self.group, rank=self.rank, device=self.device)
        setup.on_demand.attach([entry.module for entry in model.on_demand])
        self._tensors, self._on_demand = setup.tensors, setup.on_demand
        self.enabled = True
        setattr(self.dit, MARK_ATTRIBUTE, OffloadMark.ENABLED)
        self._installed.scheduler.prime()
        if setup.held_weights:
            # The replaced weights may sit in reference cycles. A weightless DiT frees nothing,
            # and a full collection with torch and diffusers loaded costs a cold start ~0.2 s.
            gc.collect()
        total_bytes = setup.total_bytes
        self.streamed_share = self.streamed_bytes / total_bytes if total_bytes else 0.0
        self._log_enabled(setup)
        return self

    def _log_enabled(self, setup: OffloadSetup) -> None:
        model = setup.model
        logger.info(
            "dlo: enabled on %s (%s plan, lists %s): %d streamed, %d resident blocks, "
            "%d on-demand modules, streamed share %.1f%% of %d weight bytes, mode %s over %d "
            "rank(s), %s source, device slots %d bytes", type(self.dit).__name__,
            model.plan.source, ",".join(model.plan.blocks), len(model.streamed),
            len(model.resident), len(model.on_demand), 100 * self.streamed_share,
            setup.total_bytes, self.mode, self.shard_count, setup.kind.value, self.slot_bytes,
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

    # The installed hooks' shared state, None while disabled (tests and benchmarks read it).
    @property
    def _scheduler(self) -> BlockScheduler | None:
        return self._installed.scheduler if self._installed is not None else None

    @property
    def _order(self) -> ExecutionOrder | None:
        return self._installed.order if self._installed is not None else None

    @property
    def _recorder(self) -> StatsRecorder | None:
        return self._installed.recorder if self._installed is not None else None

    @property
    def _lockstep(self) -> GroupLockstep | None:
        return self._installed.lockstep if self._installed is not None else None

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
        assert self._tensors is not None and self._installed is not None and self.slots
        assert self._on_demand is not None
        lockstep = self._lockstep
        drift = lockstep.start_disable(restore=restore) if lockstep is not None else None
        restore = restore and (lockstep is None or lockstep.in_step)
        tear_down(self._installed, self._on_demand, self._tensors, self.layouts, self.slots,
                  self._streams, restore=restore)
        self._installed = None
        self._on_demand = None
        self._source = None
        self.slots = None
        self._tensors = None
        self.enabled = False
        mark_disabled(self.dit, restore=restore)
        if self._mapped_plan is not None:
            # Mappings close only after tear_down synchronized: no copy reads them any more.
            self._mapped_plan.release_sources()
            self._mapped_plan = None
        gc.collect()
        logger.info("dlo: disabled on %s", type(self.dit).__name__)
        if drift is not None:
            raise drift

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

