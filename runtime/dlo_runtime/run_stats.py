"""What the DLO backend did at run time: blocks loaded, bytes moved, time compute waited.

Owns `TransferStats` and `OffloadStats`, the plain typed records `backend.stats()` and
`OffloadHandle.stats()` return (a metrics exporter turns their fields into series), and
`StatsRecorder`, which the hook scheduler feeds on the hot path. Recording is on by default, so
it costs a few integer additions per load; the time compute waits for a slot is measured as:
- on CUDA, from a pair of timing events recorded on the compute stream around its wait on the
  slot's `ready` event, only when that event has not completed yet (a prefetch that kept up
  costs one `query()`); the pairs are read when `stats()` is called, never on the hot path;
- on the CPU, where copies run in program order, as the time the copies took.
Must not log, synchronize a device on the hot path, or decide what to load.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dlo_runtime.layout import BlockLayout
from dlo_runtime.streams import StreamSet
from dlo_runtime.transfer import DirectSource, MappedSource, StagedSource


@dataclass(frozen=True)
class TransferStats:
    """Work of the backend over one forward of the DiT, or since enable."""

    forwards: int = 0
    """Forwards of the DiT that ran to completion."""
    blocks_loaded: int = 0
    """Block transfers issued (prefetches, misses and the priming load at enable)."""
    bytes_h2d: int = 0
    """Bytes copied from host memory to the device (this rank's shards in AllGather mode)."""
    bytes_gathered: int = 0
    """Bytes this rank received through the DLO AllGather (0 in rank-local mode)."""
    slot_wait_s: float = 0.0
    """Seconds compute waited for a slot's transfer (CUDA: measured by events; CPU: the copy
    time, since copies block there)."""

    def __add__(self, other: TransferStats) -> TransferStats:
        return TransferStats(**{
            f.name: getattr(self, f.name) + getattr(other, f.name)
            for f in dataclasses.fields(self)
        })


@dataclass(frozen=True)
class OffloadStats:
    """`stats()` of a backend: the last complete forward and the totals since enable."""

    last_forward: TransferStats
    total: TransferStats
    streamed_blocks: int
    mode: str
    """`rank-local` or `allgather`; `resident` for a DiT that nothing streams (`RESIDENT`)."""


RESIDENT = OffloadStats(TransferStats(), TransferStats(), streamed_blocks=0, mode="resident")
"""`stats()` of a DiT that `pod.enable` kept resident (`offload.enabled=false`): no hook counts
its forwards, and it loads, copies and waits for nothing."""


def load_bytes(layouts: Sequence[BlockLayout], source: object) -> tuple[list[int], list[int]]:
    """Per block, the bytes one load copies host-to-device (this rank's shard when sharded, the
    padded block when staged, the tensors themselves when copied view by view) and the bytes it
    receives from the other ranks of the DLO group."""
    if isinstance(source, MappedSource):
        h2d = source.copied_bytes()  # used in place but for the views off alignment
    elif isinstance(source, DirectSource):
        h2d = [layout.tensor_bytes for layout in layouts]
    elif isinstance(source, StagedSource):
        h2d = [layout.nbytes for layout in layouts]
    else:
        h2d = [layout.nbytes // layout.shard_count for layout in layouts]
    gathered = [layout.nbytes - part if layout.shard_count > 1 else 0
                for layout, part in zip(layouts, h2d)]
    return h2d, gathered


class StatsRecorder:
    """Counters fed by the scheduler; `snapshot()` turns them into an `OffloadStats`."""

    def __init__(
        self,
        streams: StreamSet,
        *,
        h2d_bytes: Sequence[int],
        gathered_bytes: Sequence[int],
        timing_pair: Callable[[], tuple[Any, Any]] | None = None,
    ) -> None:
        self._streams = streams
        self._timing_pair = timing_pair or _cuda_timing_pair
        self._h2d = list(h2d_bytes)
        self._gathered = list(gathered_bytes)
        self._cpu_timed = not streams.is_cuda
        self.blocks = self.h2d = self.gathered = 0
        self.wait_s = 0.0
        """Counters of the forward in progress."""
        self.forward = 0
        self._last = TransferStats()
        self._total = TransferStats()
        self._pending: list[tuple[int, Any, Any]] = []
        """CUDA timing event pairs not read yet, with the forward they belong to."""
        self._spare: list[tuple[Any, Any]] = []

    def loaded(self, index: int) -> None:
        """Block `index` was issued for transfer."""
        self.blocks += 1
        self.h2d += self._h2d[index]
        self.gathered += self._gathered[index]

    def copy_started(self) -> float:
        return time.perf_counter() if self._cpu_timed else 0.0

    def copy_ended(self, started: float) -> None:
        if self._cpu_timed:
            self.wait_s += time.perf_counter() - started

    def wait(self, stream: Any, event: Any) -> None:
        """Make `stream` wait for `event`; on CUDA time the wait when it is not over already."""
        if not self._streams.is_cuda or event.query():
            stream.wait_event(event)
            return
        start, end = self._spare.pop() if self._spare else self._timing_pair()
        start.record(stream)
        stream.wait_event(event)
        end.record(stream)
        self._pending.append((self.forward, start, end))

    def step_end(self) -> None:
        """A forward of the DiT returned: its counters become `last_forward`."""
        step = TransferStats(1, self.blocks, self.h2d, self.gathered, self.wait_s)
        self._last = step
        self._total = self._total + step
        self.blocks = self.h2d = self.gathered = 0
        self.wait_s = 0.0
        self.forward += 1
        # Pairs whose wait is over are read now, so that a server that never calls stats()
        # holds at most the pairs of the forwards still running on the device.
        self._read_pending(block=False)

    def snapshot(self, *, streamed_blocks: int, mode: str) -> OffloadStats:
        self._read_pending(block=True)
        return OffloadStats(
            last_forward=self._last,
            total=self._total + TransferStats(
                0, self.blocks, self.h2d, self.gathered, self.wait_s
            ),
            streamed_blocks=streamed_blocks,
            mode=mode,
        )

    def _read_pending(self, *, block: bool) -> None:
        """Add the CUDA waits measured so far to the forward they belong to; with `block`, wait
        for pairs still queued (only `stats()` does, never the hot path)."""
        still: list[tuple[int, Any, Any]] = []
        for forward, start, end in self._pending:
            if not block and not end.query():
                still.append((forward, start, end))
                continue
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
            if forward == self.forward:
                self.wait_s += seconds
            else:
                waited = TransferStats(slot_wait_s=seconds)
                self._total = self._total + waited
                if forward == self.forward - 1:
                    self._last = self._last + waited
            self._spare.append((start, end))
        self._pending = still


def _cuda_timing_pair() -> tuple[Any, Any]:
    import torch

    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
