"""Streams and events of the DLO hot path, with a no-op stand-in for the CPU.

Owns the copy stream (host-to-device transfers), the communication stream (the DLO AllGather)
and event creation. On CUDA these are real streams and events; on the CPU every operation runs
in program order, so the stand-ins do nothing and the same scheduling code runs unchanged.
Called by the backend, the slots and the transfers; it must not decide what to wait for (the
callers do, and name the hazard at each wait).

The backend takes its `StreamSet` as an argument (a fresh one per device by default): the CPU
tests pass a model whose streams run later, in an adversarial order, and whose events enforce
exactly the edges that `record`/`wait_event` declare, so that a missing wait fails a CPU test.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import torch

from dlo_runtime.layout import ALIGN_BYTES, CUDA_ALIGN_BYTES


class Event(Protocol):
    def record(self, stream: object = None) -> None: ...

    def synchronize(self) -> None: ...


class HostMemory(Protocol):
    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor: ...


class Stream(Protocol):
    def wait_event(self, event: Event) -> None: ...


class _NullEvent:
    """CPU stand-in: work before `record` has already finished when `record` returns."""

    def record(self, stream: object = None) -> None:
        return None

    def synchronize(self) -> None:
        return None


class _NullStream:
    """CPU stand-in: operations run in program order, so waits are satisfied already."""

    def wait_event(self, event: Event) -> None:
        return None


class StreamSet:
    """The streams of one backend on one device."""

    def __init__(self, device: torch.device, host_memory: HostMemory | None = None) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        if host_memory is None and self.is_cuda:
            from dlo_runtime.pinned_arena import cuda_pinned_memory

            host_memory = cuda_pinned_memory(device)
        self.host_memory = host_memory
        """Allocator of the host arenas: page-locked at their exact size on CUDA (see
        `dlo_runtime.pinned_arena`); None allocates pageable memory (the CPU device)."""
        self.align_bytes = CUDA_ALIGN_BYTES if self.is_cuda else ALIGN_BYTES
        """Alignment of every tensor, shard and part in the flat buffers (see `layout`)."""
        self.reads_host_in_place = not self.is_cuda and host_memory is None
        """True when the device computes on pageable host memory (the CPU): rank-local blocks
        mapped from the entry are used where they lie (`MappedSource`), never copied."""
        self.copies_registered_views = self.is_cuda
        """True when views registered with the device runtime (`HostWeightPlan.sources_pinned`)
        can be copied straight to the device, so the backend picks `DirectSource` for them."""
        if self.is_cuda:
            self.copy: Stream = torch.cuda.Stream(device)
            self.comm: Stream = torch.cuda.Stream(device)
        else:
            self.copy = self.comm = _NullStream()
        self._cpu_compute = _NullStream()

    def event(self) -> Event:
        """A reusable event (recording again replaces the previous point)."""
        return torch.cuda.Event() if self.is_cuda else _NullEvent()

    def compute(self) -> Stream:
        """The stream the model's kernels run on (the current stream at call time)."""
        return torch.cuda.current_stream(self.device) if self.is_cuda else self._cpu_compute

    @contextlib.contextmanager
    def on(self, stream: Stream) -> Iterator[None]:
        """Make `stream` current for the kernels and copies issued inside."""
        if self.is_cuda:
            with torch.cuda.stream(stream):  # type: ignore[arg-type]
                yield
        else:
            yield

    def synchronize(self) -> None:
        """Block the host until every queued copy, collective and kernel has finished."""
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer, page-locked on CUDA so that copies from it are asynchronous."""
        if self.host_memory is not None:
            return self.host_memory.empty(numel, dtype)
        return torch.empty(numel, dtype=dtype)
