"""`build_network_policy`: who may connect to a DOD's pods (its workload and prefill pods).

A loader's ports are the fill group's: rank 0's rendezvous store (`loader.port`), each member's
own store and gloo's pair connections (ports the system picks), and the metrics port, which
also serves `/summary` and the entry's ranges to refilling peers. None of them authenticates a
connection by itself, so the policy admits

- every port from the DOD's own pods (workload and prefill pods carry its deployment label; a
  pod of the namespace can copy that label, but the namespace is the tenant boundary);
- the metrics port from the operator's namespace (progress reads, fill summaries) and from the
  namespaces the Prometheus that scrapes the chart's PodMonitor runs in;
- the ports the DOD declares in `inference.ports` from anywhere: the server's clients.

Anything else is refused: a pod of another namespace reaches neither the rendezvous nor the
members' stores. The kubelet's probes come from the pod's own node, which a NetworkPolicy
never blocks. Egress is not restricted. Rendered only where the platform turns it on (the
chart's `networkPolicy.enabled`, in `spec.network_policy`: a cluster whose network plugin
enforces no NetworkPolicy ignores it). Pure; called by `manifests`.
"""

from __future__ import annotations

import copy
from typing import Any

from dlo_operator.naming import LABEL_DEPLOYMENT, Owner, child_metadata
from dlo_operator.spec import DeploymentSpec

NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
"""Set by the API server on every namespace to its name (Kubernetes 1.22+); no tenant sets it."""


def build_network_policy(owner: Owner, spec: DeploymentSpec) -> dict[str, Any] | None:
    """The DOD's NetworkPolicy, or None where the platform turned it off."""
    policy = spec.network_policy
    if not policy.enabled:
        return None
    own_pods = {"podSelector": {"matchLabels": {LABEL_DEPLOYMENT: owner.name}}}
    ingress: list[dict[str, Any]] = [{"from": [own_pods]}]
    metrics_port = spec.settings.loader.metrics_port
    if metrics_port:
        readers = list(dict.fromkeys((policy.operator_namespace, *policy.scrape_namespaces)))
        ingress.append({
            "from": [{"namespaceSelector": {"matchExpressions": [
                {"key": NAMESPACE_NAME_LABEL, "operator": "In", "values": readers}]}}],
            "ports": [{"protocol": "TCP", "port": metrics_port}]})
    if spec.inference.ports:
        ingress.append({"ports": [
            {"protocol": port.get("protocol", "TCP"), "port": copy.deepcopy(port["containerPort"])}
            for port in spec.inference.ports]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": child_metadata(owner, owner.network_policy_name),
        "spec": {"podSelector": copy.deepcopy(own_pods["podSelector"]),
                 "policyTypes": ["Ingress"], "ingress": ingress},
    }
