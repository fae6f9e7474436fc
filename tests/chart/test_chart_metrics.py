"""The chart's metrics pieces: the operator's metrics Service, the optional ServiceMonitor and
PodMonitor (Prometheus Operator kinds), and the Grafana dashboard built on the served metrics."""

from __future__ import annotations

import json
import re
from typing import Any

from dlo_contract.names import LOADER_METRICS_PORT_NAME, OPERATOR_METRICS_PORT
from dlo_loader import metrics as loader_metrics
from dlo_operator import metrics as operator_metrics
from dlo_operator.naming import LABEL_DEPLOYMENT
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
    assert endpoint["relabelings"][0]["targetLabel"] == "node"
    assert monitor["spec"]["namespaceSelector"] == {"any": True}


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
