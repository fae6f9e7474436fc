"""Every manifest the builders produce passes kubernetes-validate (strict) on 1.29 to 1.37."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import all_versions

from dlo_operator.crd_verdict import cel_rules
from dlo_operator.manifests import build_children
from dlo_operator.naming import MAX_NAME_LENGTH, Owner
from dlo_operator.prefill import build_prefill_job, build_prefill_service
from dlo_operator.spec import parse_spec
from support.pod_security import violations
from support.source_specs import SCHEME_SPECS

KUBERNETES_VERSIONS = [f"1.{minor}" for minor in range(29, 38)]
EXAMPLES = sorted(Path(__file__).parents[2].joinpath("examples").glob("*.yaml"))
BASE = {"model": {"source": "s3://models/m/"}, "inference": {"image": "server:1"}}
SPECS: dict[str, dict[str, Any]] = {
    "minimal": BASE,
    "no-gpus-one-replica": {**BASE, "gpusPerPod": 0},
    "secret-credentials": {**BASE, "model": {"source": "s3://m/p/", "credentials": {
        "secretName": "s3", "sessionTokenKey": ""}}},
    "runtime-cache-separate-root": {**BASE, "offload": {
        "useAllgather": False, "enableRuntimeCache": True, "runtimeCacheRoot": "/mnt/rt",
        "runtimeCachePinLimitGiB": 1.5}},
    "offload-disabled": {**BASE, "offload": {"enabled": False}},
    "scheduling": {**BASE, "replicas": 8, "nodeSelector": {"pool": "gpu"},
                   "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
                   "affinity": {"podAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                       {"weight": 1, "podAffinityTerm": {"topologyKey": "zone", "labelSelector": {
                           "matchLabels": {"app": "cache"}}}}]}},
                   "serviceAccountName": "reader", "automountServiceAccountToken": True},
    "inference-full": {**BASE, "inference": {
        "image": "server:1", "imagePullPolicy": "Always", "command": ["python"],
        "args": ["-m", "s"],
        "env": [{"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "ports": [{"name": "http", "containerPort": 8000}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}},
        "resources": {"requests": {"cpu": "4"}, "limits": {"memory": "64Gi"}}},
        "loader": {"resources": {"requests": {"cpu": "500m"}}, "port": 30000}},
    "pod-complete": {**BASE, "imagePullSecrets": [{"name": "regcred"}],
                     "priorityClassName": "high", "runtimeClassName": "nvidia",
                     "podLabels": {"team": "ml"}, "podAnnotations": {"scrape": "true"},
                     "volumes": [{"name": "lora", "persistentVolumeClaim": {"claimName": "a"}}],
                     "shmSize": "16Gi", "disruptionBudget": {"enabled": True,
                                                             "maxUnavailable": "25%"},
                     "inference": {
                         "image": "server:1", "ports": [{"containerPort": 8000}],
                         "volumeMounts": [{"name": "lora", "mountPath": "/adapters"}],
                         "startupProbe": {"httpGet": {"path": "/h", "port": 8000},
                                          "failureThreshold": 60},
                         "livenessProbe": {"tcpSocket": {"port": 8000}}}},
    **{f"source-{case}": spec for case, spec in SCHEME_SPECS.items()},
}
OPTIONAL_CHILDREN = {"spec:inference-full": 1, "spec:pod-complete": 2,
                     "example:flux-dp-allgather.yaml": 2, "example:flux-hub-gated.yaml": 1}
"""The inference Service (where ports are declared) and the PodDisruptionBudget (if enabled);
every case also has its NetworkPolicy and its fill Secret."""


def _manifests() -> list[tuple[str, dict[str, Any]]]:
    owner = Owner(name="dod", namespace="ns", uid="0b5e7b57-5b1c-4b39-9d7e-3f8f4f6c7a10")
    cases = [(f"spec:{name}", spec) for name, spec in SPECS.items()]
    cases += [(f"example:{path.name}", yaml.safe_load(path.read_text())["spec"])
              for path in EXAMPLES]
    return [(f"{case}:{child['kind']}:{child['metadata']['name']}", child)
            for case, spec in cases for child in _all_children(owner, parse_spec(spec))]


def _all_children(owner: Owner, spec: Any) -> list[dict[str, Any]]:
    """What a create makes, plus what a model change adds (the prefill Job and its Service)."""
    return [*build_children(owner, spec), build_prefill_service(owner, spec),
            build_prefill_job(owner, spec, ["gpu-a", "gpu-b"])]


MANIFESTS = _manifests()


def test_the_installed_validator_ships_every_version() -> None:
    shipped = {".".join(v.split(".")[:2]) for v in all_versions()}
    assert set(KUBERNETES_VERSIONS) <= shipped


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_built_manifest_is_valid_for(version: str) -> None:
    assert len(MANIFESTS) == 8 * (len(SPECS) + len(EXAMPLES)) + sum(OPTIONAL_CHILDREN.values())
    policies = [case for case, manifest in MANIFESTS if manifest["kind"] == "NetworkPolicy"]
    assert len(policies) == len(SPECS) + len(EXAMPLES)  # one per DOD, each validated below
    for case, manifest in MANIFESTS:
        checked = kubernetes_validate.validate(manifest, version, strict=True)
        assert checked == version, case


def test_every_pod_the_operator_renders_passes_pod_security_baseline() -> None:
    """Tenant namespaces run under `pod-security.kubernetes.io/enforce: baseline`: no pod of a
    StatefulSet or prefill Job, of any spec or example here, mounts a hostPath or asks for more
    (issue 33; the checker is tested on known-bad pods in test_operator_pod_security.py)."""
    pods = [(case, manifest["spec"]["template"]) for case, manifest in MANIFESTS
            if manifest["kind"] in ("StatefulSet", "Job")]
    assert len(pods) == 2 * (len(SPECS) + len(EXAMPLES))
    for case, template in pods:
        assert violations(template["spec"], "baseline",
                          (template.get("metadata") or {}).get("annotations")) == [], case


def test_strict_validation_catches_a_misspelled_field() -> None:
    _, manifest = MANIFESTS[2]
    broken = {**manifest, "spec": {**manifest["spec"], "podManagmentPolicy": "Parallel"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[-1], strict=True)


def test_the_longest_allowed_name_fits_every_child_pod_and_revision_label() -> None:
    dns_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
    name = "d" * MAX_NAME_LENGTH
    spec = {**SPECS["pod-complete"], "replicas": 1000}
    children = build_children(Owner(name=name, namespace="ns"), parse_spec(spec))
    for child in children:
        assert len(child["metadata"]["name"]) <= (
            253 if child["kind"] in ("ConfigMap", "Secret", "NetworkPolicy") else 63)
        if child["kind"] == "Service":
            assert dns_1035.match(child["metadata"]["name"])
    assert len(f"{name}-{spec['replicas'] - 1}") <= 63  # pod name, a DNS label
    assert len(f"{name}-{'h' * 10}") == 63  # controller-revision-hash: <sts>-<hash>
    crd_rule = next(r for r in cel_rules() if r.id == "name-dns-1035")
    assert f"size(self.metadata.name) <= {MAX_NAME_LENGTH}" in crd_rule.rule


BASELINE_ONLY = {"spec:source-file-nfs": ["volume types: volume 'nfs' is nfs"]}
"""An inline nfs share is a `baseline` volume type the DOD chose: under `restricted` a DOD reads
its share through a persistentVolumeClaim (an NFS PersistentVolume bound to it: `file-pvc`)."""


def test_every_loader_the_operator_renders_passes_pod_security_restricted() -> None:
    """The loader, in every StatefulSet and prefill Job here, runs as the platform's non-root
    user (the node agent gave it its namespace's `cache/`): its container, with the pod's
    volumes and pod-level context, meets `restricted`. The server container is the user's."""
    loaders = 0
    for case, manifest in MANIFESTS:
        if manifest["kind"] not in ("StatefulSet", "Job"):
            continue
        pod = manifest["spec"]["template"]["spec"]
        only_loader = {**pod, **{key: [c for c in pod.get(key) or () if c["name"] == "loader"]
                                 for key in ("initContainers", "containers")}}
        loaders += len(only_loader["initContainers"]) + len(only_loader["containers"])
        assert violations(only_loader, "restricted") == BASELINE_ONLY.get(
            case.rsplit(":", 2)[0], []), case
    assert loaders == 2 * (len(SPECS) + len(EXAMPLES))
