"""The chart's metrics pieces: the operator's metrics Service, the optional ServiceMonitor and
PodMonitor (Prometheus Operator kinds), and the Grafana dashboard built on the served metrics."""

from __future__ import annotations

import json
import re
from typing import Any

from dlo_contract.names import LOADER_METRICS_PORT_NAME, OPERATOR_METRICS_PORT
from dlo_loader import metrics as loader_metrics
from dlo_operator import metrics as operator_metrics
from dlo_operator.naming import LABEL_DEPLOYMENT, Owner
from dlo_operator.prefill import build_prefill_job
from dlo_operator.spec import parse_spec
from dlo_operator.statefulset import build_statefulset
from dlo_runtime import metrics as runtime_metrics

from chart.test_chart import CHART, by_kind, render


def test_service_monitor_only_when_enabled_and_it_selects_the_metrics_service() -> None:
    assert "ServiceMonitor" not in by_kind(render()) and "PodMonitor" not in by_kind(render())
    kinds = by_kind(render({"metrics": {"serviceMonitor": {"enabled": True,
                                                           "labels": {"release": "prom"}}}}))
    assert "PodMonitor" not in kinds
    monitor, = kinds["ServiceMonitor"]
    service, = kinds["Service"]
    assert monitor["metadata"]["labels"]["release"] == "prom"
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics",
                                             "interval": "30s"}]
    assert service["spec"]["ports"] == [{"name": "metrics", "port": OPERATOR_METRICS_PORT,
                                         "targetPort": "metrics", "protocol": "TCP"}]
    container = kinds["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "metrics", "containerPort": OPERATOR_METRICS_PORT,
            "protocol": "TCP"} in container["ports"]
    pod_labels = kinds["Deployment"][0]["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()


def test_pod_monitor_scrapes_the_loader_port_of_dod_pods() -> None:
    monitor, = by_kind(render({"metrics": {"podMonitor": {"enabled": True}}}))["PodMonitor"]
    assert monitor["spec"]["selector"] == {"matchExpressions": [
        {"key": LABEL_DEPLOYMENT, "operator": "Exists"}]}
    endpoint, = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == LOADER_METRICS_PORT_NAME
    assert endpoint["relabelings"][-1]["targetLabel"] == "node"
    assert monitor["spec"]["namespaceSelector"] == {"any": True}


def meta_labels(controller: str, labels: dict[str, str]) -> dict[str, str]:
    """A pod's target labels as Prometheus' Kubernetes discovery gives them to relabeling."""
    found = {"__meta_kubernetes_pod_controller_kind": controller}
    for key, value in labels.items():
        found["__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)] = value
    return found


def kept(relabelings: list[dict[str, Any]], target: dict[str, str]) -> bool:
    """Whether Prometheus keeps `target` after the `keep` steps (regexes fully anchored)."""
    for step in relabelings:
        if step.get("action") == "keep":
            joined = step.get("separator", ";").join(
                target.get(name, "") for name in step["sourceLabels"])
            if not re.fullmatch(step["regex"], joined):
                return False
    return True


def test_pod_monitor_takes_only_the_operators_pods_and_caps_the_samples() -> None:
    """Issue 43: the PodMonitor scraped any pod of any namespace that carried the deployment
    label and a port named loader-metrics, with no sample limit. Now it keeps the workload pods
    (their StatefulSet's, labelled dlo-workload, which a DOD's podLabels may not set) and the
    prefill pods (their Job's, role prefill), and caps the samples of one scrape."""
    monitor, = by_kind(render({"metrics": {"podMonitor": {"enabled": True}}}))["PodMonitor"]
    assert monitor["spec"]["sampleLimit"] == 1000
    capped, = by_kind(render({"metrics": {"podMonitor": {"enabled": True, "sampleLimit": 50}}}))[
        "PodMonitor"]
    assert capped["spec"]["sampleLimit"] == 50
    steps = monitor["spec"]["podMetricsEndpoints"][0]["relabelings"]
    owner = Owner(name="flux", namespace="ml")
    spec = parse_spec({"model": {"source": "s3://m/p/"}, "inference": {"image": "s:1"},
                       "podLabels": {"team": "ml"}})
    workload = build_statefulset(owner, spec)["spec"]["template"]["metadata"]["labels"]
    prefill = build_prefill_job(owner, spec, ["a"])["spec"]["template"]["metadata"]["labels"]
    assert kept(steps, meta_labels("StatefulSet", workload))
    assert kept(steps, meta_labels("Job", prefill))
    for controller, labels in (("", {LABEL_DEPLOYMENT: "flux"}),  # a bare pod with the label
                               ("ReplicaSet", {LABEL_DEPLOYMENT: "flux", "app": "web"}),
                               ("Job", {LABEL_DEPLOYMENT: "flux"}),
                               ("StatefulSet", {LABEL_DEPLOYMENT: "flux"}),
                               ("", workload), ("Deployment", prefill)):
        assert not kept(steps, meta_labels(controller, labels)), (controller, labels)


def test_dashboard_uses_only_served_metrics_and_ships_in_a_config_map() -> None:
    dashboard = json.loads((CHART / "dashboards" / "dlo.json").read_text())
    served = set(loader_metrics.METRICS) | set(operator_metrics.METRICS) | set(
        runtime_metrics.METRICS)
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {name for expr in exprs for name in re.findall(r"\bdlo_[a-z0-9_]+", expr)}
    assert used <= served, used - served
    titles = {p["title"] for p in dashboard["panels"]}
    assert {"Fill throughput per node", "Bytes from the store vs from peers",
            "Compute wait per step"} <= titles
    config_map: dict[str, Any] = next(
        c for c in by_kind(render({"metrics": {"dashboard": {"enabled": True}}}))["ConfigMap"])
    assert json.loads(config_map["data"]["dlo.json"]) == dashboard
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
