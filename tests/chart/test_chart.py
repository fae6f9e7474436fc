"""The Helm chart, rendered and linted by the real Helm engine (helm-python-sdk, offline)."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from dlo_contract.deployment import NetworkPolicyConfig
from dlo_operator import cli as operator_cli
from dlo_operator.installation import InstallationConfig, LoaderImageUpdate, from_args

ROOT = Path(__file__).parents[2]
CHART = ROOT / "charts" / "dlo-operator"
KUBERNETES_VERSIONS = [f"1.{minor}" for minor in range(29, 38)]
NON_DEFAULT = {
    "image": {"repository": "registry.example.com/dlo-operator", "tag": "1.2.3",
              "pullPolicy": "Always"},
    "imagePullSecrets": [{"name": "registry"}],
    "watchNamespaces": ["inference", "batch"],
    "serviceAccount": {"create": True, "name": "dlo", "annotations": {"team": "ml"}},
    "debug": True,
    "livenessPort": 9090,
    "allowedHostPaths": ["/mnt/nvme/dlo", "/var/lib/dlo"],
    "loaderImage": {"repository": "registry.example.com/dlo-loader", "tag": "1.2.3"},
    "loaderImageUpdate": "Rolling",
    "allowedLoaderImages": ["registry.example.com/dlo-loader@sha256:" + "ab" * 32,
                            "registry.example.com/dlo-loader:1.2.4"],
    "allowedUserHostPaths": ["/mnt/datasets", "/srv/dlo-user"],
    "cachePathPrefix": "/mnt/dlo",
    "nodeCache": {"hostPath": "/mnt/nvme/dlo", "maxBytes": 2_000_000_000_000,
                  "minFreeBytes": 50_000_000_000, "uid": 1000, "gid": 2000},
    "nodeAgent": {"enabled": True, "nodeSelector": {"nvidia.com/gpu.present": "true"},
                  "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
                  "priorityClassName": "system-node-critical",
                  "resources": {"requests": {"cpu": "20m", "memory": "64Mi"}}},
    "podAnnotations": {"scrape": "false"},
    "metrics": {"port": 9191, "serviceMonitor": {"enabled": True, "interval": "15s",
                                                  "labels": {"release": "prom"}},
                "podMonitor": {"enabled": True, "interval": "10s", "sampleLimit": 500,
                               "labels": {}},
                "dashboard": {"enabled": True, "labels": {"grafana_dashboard": "1"}}},
    "networkPolicy": {"enabled": False, "scrapeNamespaces": ["monitoring", "observability"]},
    "nodeSelector": {"pool": "system"},
    "tolerations": [{"key": "system", "operator": "Exists", "effect": "NoSchedule"}],
    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "pool", "operator": "In", "values": ["system"]}]}]}}},
}


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(values, name="dlo", namespace="dlo-system", is_install=True)
    return [doc for name, text in sorted(rendered.items()) if name.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc]


def by_kind(docs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for doc in docs:
        out.setdefault(doc["kind"], []).append(doc)
    return out


@pytest.mark.parametrize("values", [None, NON_DEFAULT], ids=["defaults", "non-default"])
@pytest.mark.parametrize("kube_version", ["v1.29.0", "v1.37.0"])
def test_chart_lints_clean_in_strict_mode(values: dict[str, Any] | None,
                                          kube_version: str) -> None:
    report = helm.lint(CHART, values, strict=True, kube_version=kube_version)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("values", [None, NON_DEFAULT], ids=["defaults", "non-default"])
def test_rendered_manifests_and_crd_are_valid_for_every_version(
        values: dict[str, Any] | None) -> None:
    with helm.Chart.load(CHART) as chart:
        crds = [yaml.safe_load(c["data"]) for c in chart.crds]
    docs = [d for d in render(values) if not d["apiVersion"].startswith("monitoring.coreos.com/")]
    docs += crds
    for version in KUBERNETES_VERSIONS:
        for doc in docs:
            assert kubernetes_validate.validate(doc, version, strict=True) == version, doc["kind"]


def test_defaults_watch_every_namespace_with_a_cluster_role() -> None:
    kinds = by_kind(render())
    assert sorted(kinds) == ["ClusterRole", "ClusterRoleBinding", "DaemonSet", "Deployment",
                             "Service", "ServiceAccount", "StorageClass"]
    deployment = kinds["Deployment"][0]
    assert (deployment["spec"]["replicas"], deployment["spec"]["strategy"]) == (
        1, {"type": "Recreate"})
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["args"] == ["operator", "run", "--all-namespaces",
                                 "--liveness=http://0.0.0.0:8080/healthz", "--metrics-port=8081",
                                 "--loader-image=dlo-loader:0.1.0",
                                 "--loader-image-update=OnSpecChange",
                                 "--allowed-host-path=/var/lib/dlo",
                                 "--node-cache-max-bytes=0", "--node-cache-min-free-bytes=0",
                                 "--cache-path-prefix=/var/lib/dlo",
                                 "--node-cache-root=/var/lib/dlo", "--node-cache-uid=65532",
                                 "--node-cache-gid=65532", "--network-policy",
                                 "--operator-namespace=dlo-system"]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "liveness"}
    assert container["resources"]["requests"] == {"cpu": "100m", "memory": "128Mi"}
    assert container["image"] == "dlo-operator:0.1.0"
    for binding in kinds["ClusterRoleBinding"]:
        account = binding["roleRef"]["name"].removesuffix("-node-cache")  # the agent's own
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account,
                                        "namespace": "dlo-system"}]
    [storage_class] = kinds["StorageClass"]
    assert (storage_class["metadata"]["name"], storage_class["provisioner"],
            storage_class["volumeBindingMode"], storage_class["reclaimPolicy"]) == (
        "dlo-node-cache", "dlo.dev/node-cache", "WaitForFirstConsumer", "Delete")


def test_watching_namespaces_uses_namespaced_roles_only() -> None:
    kinds = by_kind(render(NON_DEFAULT))
    # Cluster-wide only the node-cache provisioner's volumes and nodes and the node agent's
    # volumes (no Role can grant them).
    assert [r["metadata"]["name"] for r in kinds["ClusterRole"]] == [
        "dlo-dlo-operator-node-agent", "dlo-dlo-operator-node-cache"]
    assert {rule["resources"][0] for rule in kinds["ClusterRole"][1]["rules"]} == {
        "persistentvolumes", "nodes"}
    assert [b["roleRef"]["name"] for b in kinds["ClusterRoleBinding"]] == [
        "dlo-dlo-operator-node-agent", "dlo-dlo-operator-node-cache"]
    assert [(r["metadata"]["namespace"]) for r in kinds["Role"]] == ["inference", "batch"]
    bindings = kinds["RoleBinding"]
    assert [(b["metadata"]["namespace"], b["subjects"][0]["name"]) for b in bindings] == [
        ("inference", "dlo"), ("batch", "dlo")]
    args = kinds["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args == ["--debug", "operator", "run", "--namespace=inference", "--namespace=batch",
                    "--liveness=http://0.0.0.0:9090/healthz", "--metrics-port=9191",
                    "--loader-image=registry.example.com/dlo-loader:1.2.3",
                    "--loader-image-update=Rolling",
                    "--allowed-host-path=/mnt/nvme/dlo", "--allowed-host-path=/var/lib/dlo",
                    "--allowed-loader-image=registry.example.com/dlo-loader@sha256:" + "ab" * 32,
                    "--allowed-loader-image=registry.example.com/dlo-loader:1.2.4",
                    "--allowed-user-host-path=/mnt/datasets",
                    "--allowed-user-host-path=/srv/dlo-user",
                    "--node-cache-max-bytes=2000000000000",
                    "--node-cache-min-free-bytes=50000000000",
                    "--cache-path-prefix=/mnt/dlo",
                    "--node-cache-root=/mnt/nvme/dlo", "--node-cache-uid=1000",
                    "--node-cache-gid=2000", "--no-network-policy",
                    "--operator-namespace=dlo-system", "--scrape-namespace=monitoring",
                    "--scrape-namespace=observability"]


def test_operator_command_line_in_the_deployment_is_accepted_by_dlo() -> None:
    for values in (None, NON_DEFAULT):
        args = by_kind(render(values))["Deployment"][0]["spec"]["template"]["spec"][
            "containers"][0]["args"]
        args = [a for a in args if a != "--debug"]
        assert args[:2] == ["operator", "run"]
        parser = argparse.ArgumentParser()
        operator_cli.add_arguments(parser)
        parsed = parser.parse_args(args[2:])
        assert parsed.all_namespaces == (values is None)
        assert from_args(parsed) == (InstallationConfig() if values is None else (
            InstallationConfig(
                allowed_host_paths=("/mnt/nvme/dlo", "/var/lib/dlo"),
                loader_image="registry.example.com/dlo-loader:1.2.3",
                loader_image_update=LoaderImageUpdate.ROLLING,
                allowed_loader_images=tuple(values["allowedLoaderImages"]),
                allowed_user_host_paths=("/mnt/datasets", "/srv/dlo-user"),
                node_cache_max_bytes=2_000_000_000_000,
                node_cache_min_free_bytes=50_000_000_000,
                cache_path_prefix="/mnt/dlo",
                node_cache_root="/mnt/nvme/dlo", node_cache_uid=1000,
                node_cache_gid=2000, network_policy=NetworkPolicyConfig(
                    enabled=False, operator_namespace="dlo-system",
                    scrape_namespaces=("monitoring", "observability")))))


def test_rbac_grants_only_what_the_operator_uses() -> None:
    """The operator's roles (the node agent's: tests/chart/test_chart_node_agent.py)."""
    rules = [rule for role in by_kind(render())["ClusterRole"] for rule in role["rules"]
             if not role["metadata"]["name"].endswith("-node-agent")]
    granted = {(g, r): sorted(rule["verbs"]) for rule in rules
               for g in rule["apiGroups"] for r in rule["resources"]}
    assert granted == {
        ("dlo.dev", "diffusionoffloaddeployments"): ["get", "list", "patch", "watch"],
        ("dlo.dev", "diffusionoffloaddeployments/status"): ["patch"],
        ("dlo.dev", "diffusionoffloaddeployments/finalizers"): ["update"],
        ("", "pods"): ["list", "patch", "watch"],
        ("", "configmaps"): ["delete", "get", "list", "patch", "watch"],
        ("", "services"): ["delete", "get", "list", "patch", "watch"],
        ("apps", "statefulsets"): ["get", "list", "patch", "watch"],
        ("policy", "poddisruptionbudgets"): ["delete", "get", "list", "patch", "watch"],
        ("batch", "jobs"): ["delete", "get", "list", "patch", "watch"],
        ("", "events"): ["create", "list"],
        ("", "persistentvolumeclaims"): ["get", "list", "watch"],
        ("", "secrets"): ["create", "get", "patch"],
        ("networking.k8s.io", "networkpolicies"): ["delete", "get", "patch"],
        ("", "persistentvolumes"): ["create", "delete", "get", "list", "watch"],
        ("", "nodes"): ["get"],
    }


@pytest.mark.parametrize(("values", "refused"), [
    ({"nodeCache": {"maxBytes": -1}}, "minimum"),
    ({"nodeCache": {"maxbytes": 1}}, "additional properties 'maxbytes'"),
    ({"allowedUserHostPaths": ["/var/lib/../.."]}, "does not match pattern"),
    ({"allowedUserHostPaths": ["data"]}, "does not match pattern"),
    ({"allowedLoaderImages": ["evil image"]}, "does not match pattern"),
])
def test_the_platform_limits_are_checked_by_the_schema(values: dict[str, Any],
                                                       refused: str) -> None:
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError, match=refused):
        chart.validate_schema(values)


def test_values_schema_is_closed() -> None:
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(NON_DEFAULT)
        with pytest.raises(helm.HelmValuesError, match="additional properties 'replicas'"):
            chart.validate_schema({"replicas": 2})
        with pytest.raises(helm.HelmValuesError, match="additional properties 'tga'"):
            chart.validate_schema({"image": {"repository": "r", "tag": "", "tga": "x",
                                             "pullPolicy": "Always"}})


def test_every_value_in_the_schema_is_commented_in_values_yaml() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    lines = (CHART / "values.yaml").read_text().splitlines()

    def commented(key: str, indent: int) -> bool:
        pattern = re.compile(rf"^{' ' * indent}{key}:")
        for i, line in enumerate(lines):
            if pattern.match(line):
                return lines[i - 1].strip().startswith("#")
        raise AssertionError(f"{key} missing from values.yaml")

    for key, sub in schema["properties"].items():
        if "properties" in sub:
            assert all(commented(k, 2) for k in sub["properties"]), key
        else:
            assert commented(key, 0), key


def test_chart_ships_the_same_crd_as_crds_directory() -> None:
    name = "dlo.dev_diffusionoffloaddeployments.yaml"
    assert (CHART / "crds" / name).read_bytes() == (ROOT / "crds" / name).read_bytes()
