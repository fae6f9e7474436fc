"""The one-way contract from the loading code to the offload backend: where DiT weights live on
the host.

Owns `HostWeightPlan`: the backing kind (ordinary tensors, a checkpoint mapping, a runtime-cache
mapping), the tensor bindings (runtime name -> file, offset, dtype, shape), the source prefixes the
plan covers, a bounded set of declared zero-copy transforms, and the lifetime of the sources
(registration first, mapping second). Built by `checkpoint_plan` and `runtime_weight_cache`,
registered by `host_registration` when a budget allows, consumed exactly once by
`DistributedLayerwiseOffloadBackend.enable()` through `take_tensors()`.

It must not decide compatibility (the builders do), schedule transfers (the backend does) or call
a device runtime (`cuda_registration` does). Mapped views are read-only pages: writing through them
faults, so nothing here or downstream may modify them in place.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from dlo_runtime.errors import HostPlanError


MAX_TRANSFORMS = 256
"""Upper bound on declared transforms per plan: each is applied per tensor at take time, so an
unbounded list would turn a mapping into a model-sized rewrite."""


class BackingKind(str, enum.Enum):
    """Where the host copy of the DiT weights lives."""

    ORDINARY = "ordinary"
    """Private tensors produced by the ordinary loader (one copy per process)."""
    CHECKPOINT = "checkpoint"
    """Read-only shared mapping of the checkpoint entry; the ordinary DiT load was skipped."""
    RUNTIME_CACHE = "runtime_cache"
    """Read-only shared mapping of a runtime entry holding the final loaded tensors."""


@dataclass(frozen=True, kw_only=True)
class TensorBinding:
    """One runtime tensor's source: `name` as in `named_parameters()`/persistent buffers of the
    DiT, `file` relative to the entry, `offset` of its first byte in that file."""

    name: str
    file: str
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True, kw_only=True)
class DeclaredTransform:
    """A loader-owned adapter for one tensor: the stored layout is viewed as `shape` (same
    element count and dtype). Views only, so the mapping stays zero-copy and registrable."""

    name: str
    shape: tuple[int, ...]


class MappedSource(Protocol):
    """What a mapped plan needs from `dlo_runtime.mapping`: zero-copy views and a close."""

    def view(self, binding: TensorBinding) -> torch.Tensor: ...

    def close(self) -> None: ...


class Registration(Protocol):
    """A live host registration (see `host_registration`); undone before the mapping closes."""

    def unregister(self) -> None: ...


def runtime_tensors(dit: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer by its `state_dict` name: what a plan must cover."""
    tensors = dict(dit.named_parameters())
    for module_name, module in dit.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and name not in module._non_persistent_buffers_set:
                tensors[f"{module_name}.{name}" if module_name else name] = buffer
    return tensors


class HostWeightPlan:
    """Host sources of one DiT, handed from the loading code to the backend exactly once."""

    def __init__(
        self,
        *,
        backing_kind: BackingKind,
        bindings: Sequence[TensorBinding] = (),
        covered_prefixes: Sequence[str] = (),
        transforms: Sequence[DeclaredTransform] = (),
        source: MappedSource | None = None,
        tensors: Mapping[str, torch.Tensor] | None = None,
        skips_ordinary_load: bool = False,
    ) -> None:
        mapped = backing_kind is not BackingKind.ORDINARY
        if mapped != (source is not None) or mapped == (tensors is not None):
            raise ValueError(f"a {backing_kind.value} plan needs "
                             f"{'a mapped source' if mapped else 'ordinary tensors'}")
        self.backing_kind = backing_kind
        self.bindings = tuple(bindings)
        self.covered_prefixes = tuple(covered_prefixes)
        self.transforms = _check_transforms(self.bindings, transforms)
        self.skips_ordinary_load = skips_ordinary_load
        self._source = source
        self._tensors = dict(tensors) if tensors is not None else None
        self._views: dict[str, torch.Tensor] | None = None
        self._registration: Registration | None = None
        self._taken = False
        self._released = False

    @classmethod
    def ordinary(cls, tensors: Mapping[str, torch.Tensor]) -> HostWeightPlan:
        return cls(backing_kind=BackingKind.ORDINARY, tensors=tensors)

    @property
    def taken(self) -> bool:
        return self._taken

    @property
    def sources_pinned(self) -> bool:
        """True when every source view is registered with the device runtime, so the backend
        may copy views straight to the device without a staging slot."""
        return self._registration is not None

    def source_views(self) -> dict[str, torch.Tensor]:
        """The tensors `take_tensors()` will hand out, for registration and content checks that
        run before the backend takes the plan. Built once, so addresses stay stable."""
        if self._released:
            raise HostPlanError("the plan's sources were released; no views remain")
        if self._views is None:
            self._views = self._build_views()
        return self._views

    def take_tensors(self) -> dict[str, torch.Tensor]:
        """Hand the host sources to the backend. Exactly once: a second consumer would stream
        weights the first one may already have released."""
        if self._taken:
            raise HostPlanError(
                f"take_tensors() was already called on this {self.backing_kind.value} plan; "
                "a plan has exactly one consumer"
            )
        views = self.source_views()
        self._taken = True
        # The backend owns the tensors from here on; the plan keeps only the mapping, so that
        # dropped ordinary tensors can be freed.
        self._views = None
        self._tensors = None
        return views

    def attach_registration(self, registration: Registration) -> None:
        """Record that every view is registered; `close()` undoes it before unmapping."""
        if self._taken or self._registration is not None:
            raise HostPlanError("register the plan's sources once, before the backend takes them")
        self._registration = registration

    def release_sources(self) -> None:
        """Unregister, then drop the mapping (or the ordinary tensors): no copy reads them any
        more. Called by the backend once its AllGather shards are prepared, or at `disable` in
        rank-local mode, and by `close()`; later calls do nothing."""
        if self._released:
            return
        self._unregister()
        self._released = True
        self._views = None
        self._tensors = None
        if self._source is not None:
            self._source.close()

    def require_consumed(self) -> None:
        """Raise when this plan made the ordinary load skip the DiT and no backend took it:
        the module then holds placeholders, never weights."""
        if self.skips_ordinary_load and not self._taken:
            raise HostPlanError(
                "the DiT was built without weights for a checkpoint plan that no offload "
                "backend consumed; its parameters are placeholders",
                hint="enable the offload backend with host_plan=plan, or load the DiT ordinarily",
            )

    def close(self) -> None:
        """Shutdown order for host sources: unregister, then close the mapping. A failed
        unregister leaves the mapping referenced (unmapping registered pages is unsafe)."""
        self.release_sources()

    def _unregister(self) -> None:
        if self._registration is not None:
            self._registration.unregister()
            self._registration = None

    def _build_views(self) -> dict[str, torch.Tensor]:
        if self._tensors is not None:
            return dict(self._tensors)
        if self._source is None:
            raise HostPlanError("the ordinary tensors were handed to the backend already")
        reshape = {t.name: t.shape for t in self.transforms}
        views = {}
        for binding in self.bindings:
            view = self._source.view(binding)
            if binding.name in reshape:
                view = view.view(reshape[binding.name])
            views[binding.name] = view
        return views


def _check_transforms(
    bindings: tuple[TensorBinding, ...], transforms: Sequence[DeclaredTransform]
) -> tuple[DeclaredTransform, ...]:
    """Transforms are bounded: at most MAX_TRANSFORMS, one per bound tensor, element count
    kept (a view, never a copy)."""
    if len(transforms) > MAX_TRANSFORMS:
        raise HostPlanError(f"{len(transforms)} declared transforms exceed the bound of "
                            f"{MAX_TRANSFORMS}; load this model ordinarily")
    by_name = {b.name: b for b in bindings}
    seen: set[str] = set()
    for transform in transforms:
        binding = by_name.get(transform.name)
        if binding is None or transform.name in seen:
            raise HostPlanError(f"transform for {transform.name!r} must name exactly one bound "
                                "tensor")
        if math.prod(transform.shape) != math.prod(binding.shape):
            raise HostPlanError(
                f"transform of {transform.name!r} to shape {list(transform.shape)} does not keep "
                f"the {math.prod(binding.shape)} elements of stored shape {list(binding.shape)}"
            )
        seen.add(transform.name)
    return tuple(transforms)
