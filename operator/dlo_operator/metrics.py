"""The operator's Prometheus metrics, served by `dlo operator run --metrics-port P` at `/metrics`.

Owns the definitions (names with units, meanings, a few low-cardinality labels: never a pod UID
or an object name) and the recording helpers the handlers call at their outcome points. DODs by
phase are a gauge computed at scrape time from the last phase written per DOD (the key stays
inside this module). Fills are counted when a status first shows a loader's end (compared with
the previous status). Called by `handlers`, `kube` and `cli`; decides nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PHASES = ("Pending", "Loading", "Updating", "Ready", "Degraded", "Failed")
RECONCILE_OUTCOMES = ("applied", "invalid", "retried", "failed")
FILL_OUTCOMES = ("ok", "cached", "error")
PREFILL_OUTCOMES = ("started", "succeeded", "failed", "superseded")
API_ERROR_KINDS = ("conflict", "throttled", "unavailable", "forbidden", "not_found", "invalid",
                   "other")

METRICS: dict[str, tuple[str, str]] = {
    "dlo_operator_reconciles_total": (
        "counter", "Reconciles of a DOD spec; label `outcome`: " + ", ".join(RECONCILE_OUTCOMES)
        + " (children applied, spec invalid, API busy so retried with backoff, API refused)."),
    "dlo_operator_deployments": (
        "gauge", "DODs by the phase the operator last wrote; label `phase`: "
        + ", ".join(PHASES) + "."),
    "dlo_operator_fills_total": (
        "counter", "Loader fills seen ending; label `outcome`: " + ", ".join(FILL_OUTCOMES)
        + " (filled, found cached, failed)."),
    "dlo_operator_prefills_total": (
        "counter", "Prefills of a new cache entry on the serving nodes before a rollout; label "
        "`outcome`: " + ", ".join(PREFILL_OUTCOMES) + "."),
    "dlo_operator_api_errors_total": (
        "counter", "Kubernetes API errors; label `kind`: " + ", ".join(API_ERROR_KINDS) + "."),
    "dlo_operator_progress_reads_total": (
        "counter", "Reads of loader metrics endpoints for live progress; label `outcome`: "
        "ok, unreachable."),
}
"""Every metric this module serves: name -> (type, meaning). The README list is generated
from it."""

REGISTRY = CollectorRegistry(auto_describe=True)
RECONCILES = Counter("dlo_operator_reconciles", METRICS["dlo_operator_reconciles_total"][1],
                     ["outcome"], registry=REGISTRY)
FILLS = Counter("dlo_operator_fills", METRICS["dlo_operator_fills_total"][1], ["outcome"],
                registry=REGISTRY)
PREFILLS = Counter("dlo_operator_prefills", METRICS["dlo_operator_prefills_total"][1],
                   ["outcome"], registry=REGISTRY)
API_ERRORS = Counter("dlo_operator_api_errors", METRICS["dlo_operator_api_errors_total"][1],
                     ["kind"], registry=REGISTRY)
PROGRESS_READS = Counter("dlo_operator_progress_reads",
                         METRICS["dlo_operator_progress_reads_total"][1], ["outcome"],
                         registry=REGISTRY)
for _outcome in RECONCILE_OUTCOMES:
    RECONCILES.labels(outcome=_outcome)
for _outcome in FILL_OUTCOMES:
    FILLS.labels(outcome=_outcome)
for _outcome in PREFILL_OUTCOMES:
    PREFILLS.labels(outcome=_outcome)
_PREFILL_REASONS = {"PrefillStarted": "started", "PrefillSucceeded": "succeeded",
                    "PrefillFailed": "failed", "PrefillSuperseded": "superseded"}


def api_error_kind(status: int | None) -> str:
    kinds = {409: "conflict", 429: "throttled", 401: "forbidden", 403: "forbidden",
             404: "not_found", 400: "invalid", 422: "invalid"}
    if status is None or status >= 500:
        return "unavailable"
    return kinds.get(status, "other")


def record_api_error(status: int | None) -> None:
    API_ERRORS.labels(kind=api_error_kind(status)).inc()


class _Deployments(Collector):
    """`dlo_operator_deployments{phase}` from the last phase written per DOD."""

    def __init__(self) -> None:
        self._phases: dict[tuple[str, str], str] = {}
        self._lock = threading.Lock()

    def set_phase(self, namespace: str, name: str, phase: str | None) -> None:
        with self._lock:
            if phase is None:
                self._phases.pop((namespace, name), None)
            else:
                self._phases[(namespace, name)] = phase

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            phases = list(self._phases.values())
        family = GaugeMetricFamily("dlo_operator_deployments",
                                   METRICS["dlo_operator_deployments"][1], labels=["phase"])
        for phase in PHASES:
            family.add_metric([phase], phases.count(phase))
        yield family


def _fill_outcome(node: Mapping[str, Any]) -> str | None:
    if node.get("loader") == "Failed" and node.get("message"):
        return "error"
    if node.get("loader") == "Cached" and "cached" in node:  # once its summary is known
        # (a sidecar's arrives after its readiness); a node that moved no byte found it cached
        moved = node.get("bytesFromStore", 0) or node.get("bytesFromPeers", 0)
        return "ok" if moved else "cached"
    return None


DEPLOYMENTS = _Deployments()
REGISTRY.register(DEPLOYMENTS)


def record_status(namespace: str, name: str, status: Mapping[str, Any],
                  previous: Mapping[str, Any] | None) -> None:
    """After a status write: the DOD's phase, and each loader whose end the new status shows
    first (a node row whose loader state, restart count or known outcome changed into an
    end)."""
    DEPLOYMENTS.set_phase(namespace, name, status.get("phase"))
    before = {n.get("pod"): n for n in (previous or {}).get("nodes") or ()}
    for node in status.get("nodes") or ():
        outcome = _fill_outcome(node)
        old = before.get(node.get("pod")) or {}
        if outcome is not None and (old.get("loader"), old.get("restarts"), _fill_outcome(old)
                                    ) != (node.get("loader"), node.get("restarts"), outcome):
            FILLS.labels(outcome=outcome).inc()


def record_reconcile(outcome: str, owner: Any, status: Mapping[str, Any],
                     previous: Mapping[str, Any] | None, reports: Sequence[Any] = ()) -> None:
    """After one reconcile: its outcome, the status it wrote, and the prefill Events it posted."""
    RECONCILES.labels(outcome=outcome).inc()
    record_status(owner.namespace, owner.name, status, previous)
    for report in reports:
        prefill = _PREFILL_REASONS.get(getattr(report, "reason", ""))
        if prefill is not None:
            PREFILLS.labels(outcome=prefill).inc()


def serve(port: int, addr: str = "0.0.0.0") -> int:
    """Serve `/metrics` from a daemon thread for the life of the process; returns the port."""
    server, _thread = start_http_server(port, addr=addr, registry=REGISTRY)
    return int(server.server_port)
