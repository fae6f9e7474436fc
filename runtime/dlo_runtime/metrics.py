"""The backend's run-time statistics as Prometheus metrics, for the inference server's registry.

`registry.register(OffloadCollector(handle.stats))` in a server that has its own `/metrics`;
`serve(handle.stats, port)` is the one-line helper for one that has none. `stats` is any callable
returning the backend's statistics record (`dlo_runtime.run_stats.OffloadStats`, described here
by a protocol so this module stays torch-free: `OffloadHandle.stats`, `backend.stats`, or
`lambda: handle.stats("transformer_2")` with `component="transformer_2"`): the totals since
enable (forwards, blocks loaded, bytes copied host-to-device, bytes gathered, seconds compute
waited for a slot) and the last complete forward. The record is read at scrape time, so nothing
is counted twice and the hot path pays nothing. Once the handle is closed (a model swapped out,
shutdown), `stats` raises `NoStatistics` and the collector reports nothing: the server's other
metrics keep being scraped. Must not import torch (the server may register it before loading).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dlo_runtime.errors import NoStatistics

METRICS: dict[str, tuple[str, str]] = {
    "dlo_runtime_forwards_total": ("counter", "Forwards of the DiT that ran to completion."),
    "dlo_runtime_blocks_loaded_total": (
        "counter", "Block transfers issued (prefetches, misses and the priming load)."),
    "dlo_runtime_h2d_bytes_total": (
        "counter", "Bytes copied host-to-device (this rank's shards in AllGather mode)."),
    "dlo_runtime_gathered_bytes_total": (
        "counter", "Bytes received through the DLO AllGather (0 in rank-local mode)."),
    "dlo_runtime_compute_wait_seconds_total": (
        "counter", "Seconds compute waited for a block's transfer; divide its rate by the "
        "forwards' rate for the wait per step."),
    "dlo_runtime_last_forward_compute_wait_seconds": (
        "gauge", "Seconds compute waited for transfers during the last complete forward."),
    "dlo_runtime_streamed_blocks": ("gauge", "Blocks streamed through the device slots."),
}
"""Every metric this module serves (label `component`: the pipeline's DiT attribute, e.g.
`transformer`): name -> (type, meaning). The README list is generated from it."""

_TOTALS = {
    "dlo_runtime_forwards": "forwards",
    "dlo_runtime_blocks_loaded": "blocks_loaded",
    "dlo_runtime_h2d_bytes": "bytes_h2d",
    "dlo_runtime_gathered_bytes": "bytes_gathered",
    "dlo_runtime_compute_wait_seconds": "slot_wait_s",
}
"""Counter (without `_total`) -> field of the statistics record."""


class TransferFigures(Protocol):
    forwards: int
    blocks_loaded: int
    bytes_h2d: int
    bytes_gathered: int
    slot_wait_s: float


class StatsRecord(Protocol):
    last_forward: TransferFigures
    total: TransferFigures
    streamed_blocks: int


class OffloadCollector(Collector):
    """Calls `stats()` at each scrape; `component` labels every series."""

    def __init__(self, stats: Callable[[], StatsRecord], component: str = "transformer") -> None:
        self.stats = stats
        self.component = component

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        try:
            record = self.stats()
        except NoStatistics:
            return
        labels = [self.component]
        for name, field in _TOTALS.items():
            family = CounterMetricFamily(name, METRICS[f"{name}_total"][1], labels=["component"])
            family.add_metric(labels, getattr(record.total, field))
            yield family
        for name, value in (
            ("dlo_runtime_last_forward_compute_wait_seconds", record.last_forward.slot_wait_s),
            ("dlo_runtime_streamed_blocks", record.streamed_blocks),
        ):
            family = GaugeMetricFamily(name, METRICS[name][1], labels=["component"])
            family.add_metric(labels, value)
            yield family


def serve(stats: Callable[[], StatsRecord], port: int, *, component: str = "transformer",
          addr: str = "0.0.0.0") -> Any:
    """`/metrics` with only the backend's series on `port`, from a daemon thread; returns the
    HTTP server (its `server_port`, `shutdown()`)."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(OffloadCollector(stats, component))
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    return server
