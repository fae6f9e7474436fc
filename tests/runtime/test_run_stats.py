"""Run-time statistics: per forward and since enable, blocks loaded, bytes copied and gathered,
and the time compute waited for a slot (the copy time on the CPU; timing events on CUDA, read
only when `stats()` is called)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from support.runtime_helpers import forward, offload_settings

from dlo_bench.models import example_inputs, tiny_model
from dlo_runtime.backend import DistributedLayerwiseOffloadBackend
from dlo_runtime.run_stats import OffloadStats, StatsRecorder, TransferStats
from dlo_runtime.tensors import OffloadError


def test_rank_local_stats_per_forward_and_since_enable() -> None:
    model = tiny_model("flux")
    inputs = example_inputs("flux", model)
    backend = DistributedLayerwiseOffloadBackend(
        model, settings=offload_settings(use_allgather=False), device="cpu")
    with pytest.raises(OffloadError, match="^DLO is not enabled on this model$"):
        backend.stats()
    with backend:
        block_bytes = sum(layout.nbytes for layout in backend.layouts)
        blocks = len(backend.layouts)
        first = backend.stats()
        assert first.total == TransferStats(
            blocks_loaded=1, bytes_h2d=backend.layouts[0].nbytes,
            slot_wait_s=first.total.slot_wait_s)
        for _ in range(3):
            forward(model, inputs)
        stats = backend.stats()
    assert (stats.streamed_blocks, stats.mode) == (blocks, "rank-local")
    last = stats.last_forward
    assert (last.forwards, last.blocks_loaded, last.bytes_h2d, last.bytes_gathered) == (
        1, blocks, block_bytes, 0)
    assert last.slot_wait_s > 0  # the copies, which block on the CPU
    assert (stats.total.forwards, stats.total.blocks_loaded, stats.total.bytes_h2d) == (
        3, 3 * blocks + 1, 3 * block_bytes + backend.layouts[0].nbytes)
    assert stats.total.slot_wait_s > last.slot_wait_s


class Clock:
    """Stands for the device: a stream's wait on an unfinished event takes 2.5 ms."""

    def __init__(self) -> None:
        self.ms = 0.0


class TimingEvent:
    def __init__(self, clock: Clock) -> None:
        self.clock, self.at, self.syncs = clock, 0.0, 0

    def record(self, stream: Any = None) -> None:
        self.at = self.clock.ms

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self.syncs += 1

    def elapsed_time(self, end: TimingEvent) -> float:
        return end.at - self.at


class ReadyEvent:
    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


class Stream:
    def __init__(self, clock: Clock) -> None:
        self.clock, self.waits = clock, 0

    def wait_event(self, event: ReadyEvent) -> None:
        self.waits += 1
        if not event.done:
            self.clock.ms += 2.5


def test_cuda_waits_are_timed_by_events_only_when_the_slot_is_not_ready() -> None:
    clock = Clock()
    pairs: list[tuple[TimingEvent, TimingEvent]] = []

    def timing_pair() -> tuple[TimingEvent, TimingEvent]:
        pairs.append((TimingEvent(clock), TimingEvent(clock)))
        return pairs[-1]

    recorder = StatsRecorder(SimpleNamespace(is_cuda=True), h2d_bytes=[10, 20],
                             gathered_bytes=[30, 60], timing_pair=timing_pair)
    compute = Stream(clock)
    recorder.loaded(0)
    recorder.wait(compute, ReadyEvent(done=True))  # prefetch kept up: no timing pair
    assert pairs == []
    recorder.loaded(1)
    recorder.wait(compute, ReadyEvent(done=False))
    recorder.step_end()  # the pair's end has completed: read here, without blocking
    recorder.loaded(0)
    recorder.wait(compute, ReadyEvent(done=False))  # reuses the pair read at step end
    assert len(pairs) == 1 and compute.waits == 3
    stats = recorder.snapshot(streamed_blocks=2, mode="allgather")
    assert stats == OffloadStats(
        last_forward=TransferStats(1, 2, 30, 90, 0.0025),
        total=TransferStats(1, 3, 40, 120, 0.005),
        streamed_blocks=2, mode="allgather")
    assert all(type(v) in (int, float) for v in vars(stats.total).values())
