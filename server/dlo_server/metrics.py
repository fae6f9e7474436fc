"""The server's own Prometheus metrics, beside the runtime's offload statistics
(`dlo_runtime.metrics.OffloadCollector`, registered once the DiT is enabled).

Owns the metric names and meanings (`METRICS`; the README list is generated from it) and one
registry per server. Must not import torch.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

METRICS: dict[str, tuple[str, str]] = {
    "dlo_server_request_seconds": (
        "histogram", "Seconds from a generation request's arrival to its answer; label "
        "`outcome`: ok, invalid, busy, unavailable, failed (400 or 413, 503 queue full, 503 "
        "not ready or stopping, 500), abandoned (the client went away first; its queued "
        "images were dropped)."),
    "dlo_server_queue_depth": ("gauge", "Images accepted and not yet in a wave."),
    "dlo_server_requests_in_flight": (
        "gauge", "Generation requests accepted into the queue and not yet answered (queued or "
        "being made)."),
    "dlo_server_waves_total": (
        "counter", "Waves run over the AllGather group (up to one image per rank, one step "
        "count); none in rank-local mode, where each rank takes the next image when free."),
    "dlo_server_images_total": ("counter", "Images made."),
    "dlo_server_idle_slots_total": (
        "counter", "Wave slots without a job: in AllGather mode that rank ran the wave's "
        "forwards on the smallest latent and dropped the output."),
    "dlo_server_wave_seconds": ("histogram", "Seconds a wave took on rank 0, gathers included."),
}
"""Every metric `dlo serve` adds on `/metrics`: name -> (type, meaning)."""

_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class ServerMetrics:
    """The server's series in a registry of its own (served on `/metrics`)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry

        def meaning(name: str) -> str:
            return METRICS[name][1]

        self.request_seconds = Histogram("dlo_server_request_seconds",
                                         meaning("dlo_server_request_seconds"), ["outcome"],
                                         buckets=_BUCKETS, registry=reg)
        self.queue_depth = Gauge("dlo_server_queue_depth", meaning("dlo_server_queue_depth"),
                                 registry=reg)
        self.in_flight = Gauge("dlo_server_requests_in_flight",
                               meaning("dlo_server_requests_in_flight"), registry=reg)
        self.waves = Counter("dlo_server_waves", meaning("dlo_server_waves_total"), registry=reg)
        self.images = Counter("dlo_server_images", meaning("dlo_server_images_total"),
                              registry=reg)
        self.idle_slots = Counter("dlo_server_idle_slots", meaning("dlo_server_idle_slots_total"),
                                  registry=reg)
        self.wave_seconds = Histogram("dlo_server_wave_seconds",
                                      meaning("dlo_server_wave_seconds"), buckets=_BUCKETS,
                                      registry=reg)
