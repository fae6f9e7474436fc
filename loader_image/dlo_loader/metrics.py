"""The loader's Prometheus metrics: what `/metrics` serves while `dlo cache fill` runs.

Owns the metric definitions (names, meanings, labels) and the endpoint. The byte counters and the
phase are read from the fill's `Progress` at scrape time (one source of truth, nothing counted
twice); retries are counted where the object store retries (`record_retry`), by a reason class
of a handful of values. The operator reads `dlo_loader_bytes_done_bytes`, `..._total_bytes`,
`..._throughput_bytes_per_second` and `dlo_loader_stalled` for the live progress in the DOD
status (`dlo_operator.progress`). One fill per process, so the registry is the module's.
Called by `fill` (attach), `source` (retries) and `cli` (serve). Must not decide anything.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dlo_contract.fill_proof import proven
from dlo_contract.names import LOADER_PROOF_HEADER, LOADER_SUMMARY_PATH
from dlo_loader.bounded_server import BoundedServer
from dlo_loader.peer_serve import ENTRY_PATH

if TYPE_CHECKING:
    from dlo_loader.progress import Progress

PHASES = ("listing", "waiting", "transferring", "checking", "done", "failed")
"""Where a fill is: listing the source, waiting for the lock or the group, moving bytes,
checking headers and digests, finished, failed."""
RETRY_REASONS = ("throttled", "server_error", "short_body", "stalled", "connection", "other")
THROUGHPUT_WINDOW_S = 10.0

METRICS: dict[str, tuple[str, str]] = {
    "dlo_loader_bytes_from_store_total": ("counter", "Bytes read from the object store."),
    "dlo_loader_bytes_from_peers_total": ("counter", "Bytes received from peer loaders."),
    "dlo_loader_bytes_to_peers_total": ("counter",
        "Bytes sent to peer loaders (once per receiving peer)."),
    "dlo_loader_bytes_served_total": ("counter",
        "Bytes of this node's published entry served to the loaders of the same DOD refilling "
        "their node from it (at most loader.peerServeBytesPerSecond)."),
    "dlo_loader_store_retries_total": ("counter",
           "Object-store requests retried; label `reason`: " + ", ".join(RETRY_REASONS) + "."),
    "dlo_loader_stalls_total": ("counter",
        "Times a read of the fill stalled (no bytes for loader.stallTimeoutSeconds)."),
    "dlo_loader_bytes_done_bytes": ("gauge", "Bytes of this node's entry written so far."),
    "dlo_loader_bytes_total_bytes": ("gauge", "Bytes of the whole entry."),
    "dlo_loader_throughput_bytes_per_second": ("gauge",
        f"Bytes written per second over the last {THROUGHPUT_WINDOW_S:.0f} s."),
    "dlo_loader_stalled": ("gauge", "1 while a read is stalled (until bytes arrive), else 0."),
    "dlo_loader_phase": (
        "gauge", "1 for the phase the fill is in; label `phase`: " + ", ".join(PHASES) + "."),
}
"""Every metric this module serves: name -> (type, meaning). The README list is generated
from it."""

REGISTRY = CollectorRegistry(auto_describe=True)
RETRIES = Counter("dlo_loader_store_retries", METRICS["dlo_loader_store_retries_total"][1],
                  ["reason"], registry=REGISTRY)
SERVED = Counter("dlo_loader_bytes_served", METRICS["dlo_loader_bytes_served_total"][1],
                 registry=REGISTRY)


def record_retry(reason: str) -> None:
    """Count one retry; `reason` is free text, reduced to one of `RETRY_REASONS`."""
    RETRIES.labels(reason=retry_reason(reason)).inc()


def retry_reason(reason: str) -> str:
    text = reason.lower()
    if any(word in text for word in ("slowdown", "throttl", "429", "503", "toomanyrequests")):
        return "throttled"
    if "short body" in text:
        return "short_body"
    if text.startswith("stalled"):
        return "stalled"
    if any(word in text for word in ("500", "502", "504", "internalerror", "serviceunavailable")):
        return "server_error"
    if any(word in text for word in ("connect", "reset", "timeout", "timed out", "broken pipe")):
        return "connection"
    return "other"


class FillCollector(Collector):
    """Exposes the attached fill's `Progress`; a scrape before `attach` yields no fill metrics."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._progress: Progress | None = None
        self._lock = threading.Lock()
        self._samples: collections.deque[tuple[float, int]] = collections.deque()

    def attach(self, progress: Progress) -> None:
        with self._lock:
            self._progress = progress
            self._samples.clear()

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        progress = self._progress
        if progress is None:
            return
        now = self.clock()
        with self._lock:
            done, phase = progress.bytes_written, progress.phase
            rate = self._throughput(now, done, progress.started)
            stalled = progress.stalled is not None
        counters = {"dlo_loader_bytes_from_store": progress.bytes_from_store,
                    "dlo_loader_bytes_from_peers": progress.bytes_from_peers,
                    "dlo_loader_bytes_to_peers": progress.bytes_to_peers,
                    "dlo_loader_stalls": progress.stalls}
        for name, value in counters.items():
            yield CounterMetricFamily(name, METRICS[f"{name}_total"][1], value=value)
        gauges = {"dlo_loader_bytes_done_bytes": done,
                  "dlo_loader_bytes_total_bytes": progress.total_bytes,
                  "dlo_loader_throughput_bytes_per_second": rate,
                  "dlo_loader_stalled": int(stalled)}
        for name, value in gauges.items():
            yield GaugeMetricFamily(name, METRICS[name][1], value=value)
        phases = GaugeMetricFamily("dlo_loader_phase", METRICS["dlo_loader_phase"][1],
                                   labels=["phase"])
        for name in PHASES:
            phases.add_metric([name], 1 if name == phase else 0)
        yield phases

    def _throughput(self, now: float, done: int, started: float) -> float:
        """Rate over the window from samples taken at scrapes; the average before two exist."""
        self._samples.append((now, done))
        while len(self._samples) > 2 and now - self._samples[1][0] >= THROUGHPUT_WINDOW_S:
            self._samples.popleft()
        first_time, first_done = self._samples[0]
        if now - first_time < 1.0:
            first_time, first_done = started, 0
        return max(done - first_done, 0) / max(now - first_time, 1e-9)


FILL = FillCollector()
REGISTRY.register(FILL)


_PROOF_ENVIRON = "HTTP_" + LOADER_PROOF_HEADER.upper().replace("-", "_")


class Endpoint:
    """`/metrics` on a port, the fill's summary to a reader that shows the fill `secret` (see
    `dlo_contract.fill_proof`; none without a secret), and the entry to refilling peers
    (`serve_entry`), served by a `BoundedServer` (any number of slow clients leaves it
    answering) until `close()`."""

    def __init__(self, port: int, addr: str = "0.0.0.0", *, secret: bytes | None = None) -> None:
        self._metrics = make_wsgi_app(REGISTRY)
        self._secret = secret
        self._summary: bytes | None = None
        self._entry: Callable[..., Iterable[bytes]] | None = None
        self._server = BoundedServer(addr, port, self._app)
        self.port = self._server.port

    def publish_summary(self, line: str) -> None:
        """Serve the fill's one-line summary at `LOADER_SUMMARY_PATH` from now on, to a reader
        that shows the fill secret (`LOADER_PROOF_HEADER`): a sidecar loader stays up, so the
        kubelet never shows its termination message; the operator reads the figures here
        (`dlo_operator.progress.read_summary`)."""
        self._summary = line.encode() + b"\n"

    def serve_entry(self, app: Callable[..., Iterable[bytes]]) -> None:
        """Answer the peer protocol's paths (`peer_serve.ENTRY_PATH`) with `app` from now on
        (`peer_serve.EntryServer`: the published entry, to refilling peers)."""
        self._entry = app

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path.startswith(ENTRY_PATH + "/"):
            if self._entry is None:
                start_response("404 Not Found", [("Content-Type", "text/plain")])
                return [b"no entry served: the fill has not published one\n"]
            return self._entry(environ, start_response)
        if path != LOADER_SUMMARY_PATH:
            return self._metrics(environ, start_response)
        if self._secret is None or not proven(self._secret, environ.get(_PROOF_ENVIRON, "")):
            start_response("403 Forbidden", [("Content-Type", "text/plain")])
            return [f"no proof of the DOD's fill secret in {LOADER_PROOF_HEADER}\n".encode()]
        if self._summary is None:
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"no summary: the fill has not ended\n"]
        start_response("200 OK", [("Content-Type", "application/json")])
        return [self._summary]

    def close(self) -> None:
        self._server.close()
