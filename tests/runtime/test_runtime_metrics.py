"""The backend's statistics as Prometheus metrics: the collector in a server's own registry and
the one-line endpoint, scraped over HTTP and parsed with `prometheus_client.parser`."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from support.runtime_helpers import forward, offload_settings
from support.scrape import scrape, value

from dlo_bench.models import example_inputs, tiny_model
from dlo_runtime import metrics
from dlo_runtime.backend import DistributedLayerwiseOffloadBackend


@dataclass(frozen=True)
class Figures:
    forwards: int = 0
    blocks_loaded: int = 0
    bytes_h2d: int = 0
    bytes_gathered: int = 0
    slot_wait_s: float = 0.0


@dataclass(frozen=True)
class Record:
    last_forward: Figures
    total: Figures
    streamed_blocks: int


class Stats:
    """A statistics record that moves between scrapes, as the backend's does between forwards."""

    def __init__(self) -> None:
        self.record = Record(Figures(), Figures(), streamed_blocks=19)

    def forward(self) -> None:
        step = Figures(forwards=1, blocks_loaded=19, bytes_h2d=19 << 20, bytes_gathered=57 << 20,
                       slot_wait_s=0.25)
        total = Figures(**{f: getattr(self.record.total, f) + getattr(step, f)
                           for f in Figures.__dataclass_fields__})
        self.record = replace(self.record, last_forward=step, total=total)

    def __call__(self) -> Record:
        return self.record


def test_endpoint_counters_move_with_the_statistics() -> None:
    stats = Stats()
    server = metrics.serve(stats, 0, component="transformer", addr="127.0.0.1")
    try:
        port = server.server_port
        before = scrape(port)
        stats.forward()
        stats.forward()
        after = scrape(port)
    finally:
        server.shutdown()
        server.server_close()
    labels = {"component": "transformer"}
    assert value(before, "dlo_runtime_forwards_total", **labels) == 0
    total = stats().total
    assert value(after, "dlo_runtime_forwards_total", **labels) == total.forwards == 2
    assert value(after, "dlo_runtime_blocks_loaded_total", **labels) == total.blocks_loaded
    assert value(after, "dlo_runtime_h2d_bytes_total", **labels) == total.bytes_h2d
    assert value(after, "dlo_runtime_gathered_bytes_total", **labels) == total.bytes_gathered
    assert value(after, "dlo_runtime_compute_wait_seconds_total", **labels) == 0.5
    assert value(after, "dlo_runtime_last_forward_compute_wait_seconds", **labels) == 0.25
    assert value(after, "dlo_runtime_streamed_blocks", **labels) == 19


def test_collector_registers_in_the_servers_own_registry_and_is_documented() -> None:
    registry = CollectorRegistry()
    registry.register(metrics.OffloadCollector(Stats(), component="transformer_2"))
    families = list(text_string_to_metric_families(generate_latest(registry).decode()))
    names = {f.name + ("_total" if f.type == "counter" else "") for f in families}
    assert names == set(metrics.METRICS)
    assert {s.labels["component"] for f in families for s in f.samples} == {"transformer_2"}


def test_endpoint_scraped_during_a_cpu_forward_agrees_with_the_backend_stats() -> None:
    model = tiny_model("flux")
    inputs = example_inputs("flux", model)
    with DistributedLayerwiseOffloadBackend(
            model, settings=offload_settings(use_allgather=False), device="cpu") as backend:
        server = metrics.serve(backend.stats, 0, addr="127.0.0.1")
        port = server.server_port
        mid_forward: list[dict] = []
        hook = model.transformer_blocks[-1].register_forward_hook(
            lambda *_: mid_forward.append(scrape(port)))
        try:
            before = scrape(port)
            forward(model, inputs)
            forward(model, inputs)
            after = scrape(port)
            stats = backend.stats()
        finally:
            hook.remove()
            server.shutdown()
            server.server_close()
    labels = {"component": "transformer"}
    blocks = "dlo_runtime_blocks_loaded_total"
    assert len(mid_forward) == 2
    assert value(before, blocks, **labels) < value(mid_forward[0], blocks, **labels) < value(
        after, blocks, **labels)
    assert value(mid_forward[0], "dlo_runtime_forwards_total", **labels) == 0  # not ended yet
    total = stats.total
    assert value(after, "dlo_runtime_forwards_total", **labels) == total.forwards == 2
    assert value(after, blocks, **labels) == total.blocks_loaded
    assert value(after, "dlo_runtime_h2d_bytes_total", **labels) == total.bytes_h2d > 0
    assert value(after, "dlo_runtime_gathered_bytes_total", **labels) == total.bytes_gathered
    assert value(after, "dlo_runtime_compute_wait_seconds_total", **labels) == pytest.approx(
        total.slot_wait_s)
    assert value(after, "dlo_runtime_last_forward_compute_wait_seconds", **labels) == (
        pytest.approx(stats.last_forward.slot_wait_s))
    assert value(after, "dlo_runtime_streamed_blocks", **labels) == stats.streamed_blocks
