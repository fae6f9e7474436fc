"""All-or-nothing registration of a mapped plan's pages with a device runtime.

Owns the platform-neutral lifecycle: group the plan's views by backing file, page-align them,
coalesce adjacent or overlapping ranges, check the whole byte count against the budget before any
platform call, register range by range (very large ranges split into bounded calls), verify that
every view then reports pinned, and on any failure unregister what was registered in reverse
order. The staging path stays in place after a failed attempt; partial direct transfer is never
offered. A rollback that fails raises `RegistrationError`: unmapping pages the platform still
owns would be unsafe, so startup must stop. Called by `dlo_runtime.pod` for runtime-cache plans
with a positive `offload.runtime_cache_pin_limit_gib`; the registration it attaches to the plan
is undone by the plan's `release_sources()` (or `close()`) before the mapping closes.

Must not call a device runtime itself (the platform backend, e.g. `cuda_registration`, does) nor
choose which weights are cached.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from dlo_contract.errors import PermanentError
from dlo_contract.field_names import Names, document_names
from dlo_runtime.host_weight_plan import HostWeightPlan
from dlo_runtime.errors import RegistrationError

logger = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
MAX_CALL_BYTES = 1 << 30
"""Largest range one platform call registers; bigger ranges are split so that a single call
never has to lock an unbounded span (and a failure names a small range)."""


class PlatformBackend(Protocol):
    """What a device runtime provides (see `cuda_registration.CudaRegistrationBackend`)."""

    name: str

    def unsupported_reason(self) -> str | None: ...

    def register(self, address: int, length: int) -> None: ...

    def unregister(self, address: int) -> None: ...

    def reports_pinned(self, address: int) -> bool: ...


@dataclass(frozen=True)
class HostRange:
    """Page-aligned bytes `[address, address + length)` of one mapped file."""

    file: str
    address: int
    length: int

    @property
    def end(self) -> int:
        return self.address + self.length


@dataclass(frozen=True)
class Outcome:
    """Result of `register_plan`: registered, or the reason the staging path stays."""

    registered: bool
    bytes: int
    calls: int
    reason: str | None = None


def plan_ranges(spans: Iterable[tuple[str, int, int]], *, page: int = PAGE,
                max_call_bytes: int = MAX_CALL_BYTES) -> list[HostRange]:
    """Turn `(file, address, nbytes)` spans into the page-aligned ranges to register: merged
    per file when they touch or overlap, then cut into calls of at most `max_call_bytes`."""
    by_file: dict[str, list[tuple[int, int]]] = {}
    for file, address, nbytes in spans:
        if nbytes:
            start = address - address % page
            end = -(-(address + nbytes) // page) * page
            by_file.setdefault(file, []).append((start, end))
    ranges = []
    for file in sorted(by_file):
        merged: list[list[int]] = []
        for start, end in sorted(by_file[file]):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        for start, end in merged:
            for piece in range(start, end, max_call_bytes):
                ranges.append(HostRange(file, piece, min(max_call_bytes, end - piece)))
    return ranges


_NEVER_UNMAP: list[object] = []
"""Mapped views whose registration could not be released. Holding them keeps their pages mapped
until the process exits: unmapping pages the device runtime still owns would be unsafe."""


class LiveRegistration:
    """Ranges registered with one backend; `unregister()` releases them in reverse order."""

    def __init__(self, backend: PlatformBackend, ranges: list[HostRange],
                 mapped: object) -> None:
        self._backend = backend
        self._ranges = list(ranges)
        self._mapped = mapped

    def unregister(self) -> None:
        """Release every range, newest first. Ranges that fail stay recorded (and the error is
        raised) so that the owner keeps their mapping alive."""
        failed = []
        for host_range in reversed(self._ranges):
            try:
                self._backend.unregister(host_range.address)
            except PermanentError as exc:
                failed.append((host_range, exc))
        self._ranges = [host_range for host_range, _ in reversed(failed)]
        if failed:
            _NEVER_UNMAP.append(self._mapped)
            host_range, exc = failed[0]
            raise RegistrationError(
                f"{len(failed)} registered host range(s) could not be released, first "
                f"{host_range.file} at {host_range.address:#x} ({host_range.length} bytes): {exc}",
                hint="the process must exit without unmapping these pages",
            ) from exc


def register_plan(plan: HostWeightPlan, *, budget_bytes: int, backend: PlatformBackend,
                  names: Names = document_names) -> Outcome:
    """Register every view of `plan` or none. On success the plan reports `sources_pinned`;
    otherwise it keeps its staging path and `Outcome.reason` says why (naming the budget's
    setting through `names`, the way the user wrote it)."""
    budget_setting = names("offload.runtime_cache_pin_limit_gib")
    views = plan.source_views()
    spans = [(b.file, views[b.name].data_ptr(), views[b.name].nbytes) for b in plan.bindings]
    ranges = plan_ranges(spans)
    total = sum(r.length for r in ranges)
    if total > budget_bytes:
        return _staged(total, 0, f"registration needs {total} bytes, more than the budget of "
                                 f"{budget_bytes} bytes ({budget_setting}); raise "
                                 f"{budget_setting} to at least {-(-total // 2**30)} to register "
                                 "it")
    reason = backend.unsupported_reason()
    if reason is not None:
        return _staged(total, 0, reason)
    live = LiveRegistration(backend, [], views)
    for index, host_range in enumerate(ranges):
        try:
            backend.register(host_range.address, host_range.length)
        except PermanentError as exc:
            live.unregister()  # raises RegistrationError when a rollback call fails
            return _staged(total, index + 1, f"registering range {index + 1} of {len(ranges)} "
                                             f"({host_range.file}) failed: {exc}")
        live = LiveRegistration(backend, ranges[: index + 1], views)
    unpinned = [name for name, view in views.items()
                if view.nbytes and not backend.reports_pinned(view.data_ptr())]
    if unpinned:
        live.unregister()
        return _staged(total, len(ranges), f"{len(unpinned)} mapped tensor(s) do not report "
                                           f"pinned after registration, first {unpinned[0]!r}")
    plan.attach_registration(live)
    logger.info("registered %d bytes of host mappings in %d %s call(s)", total, len(ranges),
                backend.name)
    return Outcome(True, total, len(ranges))


def _staged(total: int, calls: int, reason: str) -> Outcome:
    logger.warning("host registration skipped, keeping the staging path: %s", reason)
    return Outcome(False, total, calls, reason)
