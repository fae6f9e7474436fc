"""The NetworkPolicy of a DOD (issue 43): a pod of another namespace reached rank 0's rendezvous
store, the members' stores and the loaders' HTTP port, and joined the fill group. Now the DOD's
pods take connections on the loaders' ports only from the DOD's own pods (workload and
prefill), its metrics port also from the operator's namespace and the scrape namespaces, and
its declared inference ports from anyone. The policy is evaluated here as the NetworkPolicy API
defines it, for every example and several specs; it passes strict validation with every other
manifest (test_operator_manifests_validate.py)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import kopf
import pytest
import yaml
from support.operator_harness import (
    DOD_PATH,
    NAMESPACE,
    ClusterEmulator,
    Operator,
    eventually,
    live,
    operator_with,
    request,
)

from dlo_contract.deployment import NetworkPolicyConfig
from dlo_operator.installation import InstallationConfig
from dlo_operator.manifests import build_children
from dlo_operator.naming import Owner
from dlo_operator.network_policy import NAMESPACE_NAME_LABEL
from dlo_operator.prefill import build_prefill_job
from dlo_operator.render import render_file
from dlo_operator.spec import DeploymentSpec, parse_spec

OWNER = Owner(name="flux", namespace="ml", uid="uid-1")
EXAMPLES = sorted(Path(__file__).parents[2].joinpath("examples").glob("*.yaml"))
BASE = {"model": {"source": "s3://models/m/"}, "inference": {"image": "server:1"}}
SPECS = {
    "minimal": BASE,
    "ports-and-loader-port": {**BASE, "loader": {"port": 30000}, "inference": {
        "image": "server:1", "ports": [{"name": "http", "containerPort": 8000},
                                       {"name": "grpc", "containerPort": 9000}]}},
    "metrics-port": {**BASE, "loader": {"metricsPort": 9555}},
    **{f"example:{path.name}": yaml.safe_load(path.read_text())["spec"] for path in EXAMPLES},
}
GLOO_PORT = 41234
"""A port the system picks: gloo's pair connections and the members' own stores."""
WATCHED = NetworkPolicyConfig(operator_namespace="dlo-ops", scrape_namespaces=("monitoring",))


def selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """A LabelSelector (matchLabels and matchExpressions) against an object's labels."""
    if any(labels.get(key) != value for key, value in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or ():
        present, value = expr["key"] in labels, labels.get(expr["key"])
        if not {"In": present and value in expr.get("values", ()),
                "NotIn": not present or value not in expr.get("values", ()),
                "Exists": present, "DoesNotExist": not present}[expr["operator"]]:
            return False
    return True


def admits(policy: Mapping[str, Any], *, namespace: str, labels: Mapping[str, str],
           port: int) -> bool:
    """Whether `policy` (of namespace OWNER.namespace) admits a TCP connection to `port` of a
    pod it selects, from a pod with `labels` in `namespace` (namespaces carry their name label,
    which the API server sets)."""
    for rule in policy["spec"]["ingress"]:
        if "ports" in rule and not any(p["port"] == port and p.get("protocol", "TCP") == "TCP"
                                       for p in rule["ports"]):
            continue
        peers = rule.get("from")
        if not peers:
            return True
        for peer in peers:
            if "namespaceSelector" in peer:
                in_namespace = selects(peer["namespaceSelector"], {NAMESPACE_NAME_LABEL: namespace})
            else:
                in_namespace = namespace == OWNER.namespace
            if in_namespace and selects(peer.get("podSelector") or {}, labels):
                return True
    return False


def children(spec: DeploymentSpec) -> dict[str, dict[str, Any]]:
    return {child["kind"]: child for child in build_children(OWNER, spec)}


def with_policy(raw: Mapping[str, Any], policy: NetworkPolicyConfig) -> DeploymentSpec:
    return parse_spec(raw).model_copy(update={"network_policy": policy})


@pytest.mark.parametrize("case", SPECS)
def test_only_the_dods_own_pods_reach_its_loaders(case: str) -> None:
    spec = with_policy(SPECS[case], WATCHED)
    built = children(spec)
    policy = built["NetworkPolicy"]
    workload = built["StatefulSet"]["spec"]["template"]["metadata"]["labels"]
    prefill = build_prefill_job(OWNER, spec, ["a", "b"])["spec"]["template"]["metadata"]["labels"]
    assert policy["metadata"]["namespace"] == OWNER.namespace
    assert policy["spec"]["policyTypes"] == ["Ingress"]  # egress is not restricted
    assert selects(policy["spec"]["podSelector"], workload)
    assert selects(policy["spec"]["podSelector"], prefill)

    loader_ports = [spec.loader.port, GLOO_PORT]
    metrics = spec.settings.loader.metrics_port
    for port in [*loader_ports, metrics]:
        for labels in (workload, prefill):
            assert admits(policy, namespace=OWNER.namespace, labels=labels, port=port), port
        # Another namespace, even with the DOD's labels copied; a pod of the namespace that
        # is not the DOD's; another DOD's pod.
        assert not admits(policy, namespace="tenant-b", labels=workload, port=port), port
        assert not admits(policy, namespace=OWNER.namespace, labels={"app": "web"}, port=port)
        assert not admits(policy, namespace=OWNER.namespace, port=port, labels={
            **workload, "dlo.dev/deployment": "other"})
    for namespace in ("dlo-ops", "monitoring"):
        assert admits(policy, namespace=namespace, labels={}, port=metrics) == bool(metrics)
        for port in loader_ports:
            assert not admits(policy, namespace=namespace, labels={}, port=port)
    for port in spec.inference.ports:
        assert admits(policy, namespace="tenant-b", labels={}, port=port["containerPort"])


def test_without_a_metrics_port_no_namespace_is_let_in() -> None:
    policy = children(with_policy({**BASE, "loader": {"metricsPort": 0}}, WATCHED))[
        "NetworkPolicy"]
    assert policy["spec"]["ingress"] == [
        {"from": [{"podSelector": {"matchLabels": {"dlo.dev/deployment": "flux"}}}]}]


def test_the_platform_turns_it_off_for_a_cluster_without_a_policy_engine(tmp_path: Path) -> None:
    off = with_policy(BASE, NetworkPolicyConfig(enabled=False))
    assert "NetworkPolicy" not in children(off)
    path = tmp_path / "dod.yaml"
    path.write_text(EXAMPLES[0].read_text())
    rendered = [doc["kind"] for doc in yaml.safe_load_all(render_file(
        path, installation=InstallationConfig(network_policy=NetworkPolicyConfig(
            enabled=False))))]
    assert "NetworkPolicy" not in rendered
    assert "NetworkPolicy" in [doc["kind"] for doc in yaml.safe_load_all(render_file(path))]


async def test_turning_it_off_deletes_the_policy_and_on_restores_it(
        cluster: ClusterEmulator, operator: Operator) -> None:
    body = {"apiVersion": "dlo.dev/v1alpha1", "kind": "DiffusionOffloadDeployment",
            "metadata": {"name": "flux", "namespace": NAMESPACE},
            "spec": {"model": {"source": "s3://models/flux/"},
                     "inference": {"image": "server:1"}}}
    policies = "networking.k8s.io/v1/networkpolicies"
    await request(cluster, "POST", DOD_PATH, body)
    created = await eventually(lambda: live(cluster, policies, "flux"))
    assert created["spec"]["podSelector"] == {"matchLabels": {"dlo.dev/deployment": "flux"}}
    await operator.stop()
    off = InstallationConfig(network_policy=NetworkPolicyConfig(enabled=False))
    async with operator_with(kopf.Memo(installation=off)):
        await eventually(lambda: live(cluster, policies, "flux") is None)
        assert live(cluster, "apps/v1/statefulsets", "flux")
    await operator.start()
    await eventually(lambda: live(cluster, policies, "flux"))
