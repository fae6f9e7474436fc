"""The operator's RBAC is exactly what it uses: the verbs are derived from every request the
operator makes to the API emulator over a DOD's life (create, pods reporting, optional children
turned off, a refused spec, an API error, deletion), and compared with the chart's rules."""

from __future__ import annotations

from pathlib import Path

import helm_python as helm
import yaml

from support.operator_harness import (
    DOD_PATH,
    DOD_RESOURCE,
    NAMESPACE,
    PODS_PATH,
    ClusterEmulator,
    Operator,
    eventually,
    live,
    request,
    used_rules,
    workload_pod,
)

CHART = Path(__file__).parents[2] / "charts" / "dlo-operator"
NOT_OBSERVABLE = {("dlo.dev", "diffusionoffloaddeployments/finalizers"): {"update"}}
"""Checked by the API server's OwnerReferencesPermissionEnforcement admission plugin when a
child's owner reference sets blockOwnerDeletion; an emulator sees no request for it."""
AFTER_A_MODEL_CHANGE = {("", "configmaps"): {"delete"},
                        ("batch", "jobs"): {"get", "patch", "delete"}}
"""Used only by a model change (the prefill Job, created and then removed with the superseded
settings ConfigMap once the new revision serves); tests/operator/test_operator_lifecycle.py
drives that life, with stand-in Job and StatefulSet controllers."""


def chart_rules() -> dict[tuple[str, str], set[str]]:
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(None, name="dlo", namespace="dlo-system", is_install=True)
    roles = [doc for name, text in rendered.items() if name.endswith(".yaml")
             for doc in yaml.safe_load_all(text) if doc and doc["kind"] == "ClusterRole"]
    return {(group, resource): set(rule["verbs"]) for role in roles for rule in role["rules"]
            for group in rule["apiGroups"] for resource in rule["resources"]}


AFTER_A_SIDECAR_PUBLISHED = {("", "pods"): {"patch"}}
"""The operator keeps a published sidecar loader's fill summary on its pod; tests/operator/
test_operator_metrics.py drives that with a real loader endpoint."""
AFTER_A_REFUSED_POD = {("", "events"): {"list"}}
"""Used while a StatefulSet or prefill Job is short of pods (its controller's FailedCreate), which
this test may or may not catch between the StatefulSet's creation and its pod's;
tests/operator/test_operator_refused_pods.py drives it."""
AFTER_A_REPLACED_DOD = {("", "secrets"): {"patch"}}
"""Used only when a DOD meets a fill Secret whose metadata or data is not yet its own (a DOD
deleted and created again under its name, a rendered Secret applied by hand);
tests/operator/test_operator_fill_secret.py drives both."""
AFTER_THE_POLICY_TURNS_OFF = {("networking.k8s.io", "networkpolicies"): {"delete"}}
"""Used only once the platform turns networkPolicy.enabled off;
tests/operator/test_operator_network_policy.py drives it."""
AFTER_A_CACHE_CLAIM = {("", "persistentvolumes"): {"create", "get", "delete"},
                       ("", "persistentvolumeclaims"): {"get"}, ("", "nodes"): {"get"}}
"""Used only by the node-cache provisioner once a pod's claim is scheduled and once a volume's
claim is gone; tests/operator/test_operator_node_cache.py drives both."""


async def test_the_chart_grants_exactly_the_verbs_the_operator_uses(
        cluster: ClusterEmulator, operator: Operator) -> None:
    body = {"apiVersion": "dlo.dev/v1alpha1", "kind": "DiffusionOffloadDeployment",
            "metadata": {"name": "flux", "namespace": NAMESPACE},
            "spec": {"model": {"source": "s3://models/flux/"},
                     "inference": {"image": "server:1", "ports": [{"containerPort": 8000}]},
                     "disruptionBudget": {"enabled": True}}}
    cluster["patch", f"/api/v1/namespaces/{NAMESPACE}/services/flux-peers"][:1] << 503
    await request(cluster, "POST", DOD_PATH, body)
    await eventually(lambda: live(cluster, DOD_RESOURCE, "flux")["status"]["conditions"][1][
        "status"] == "True")  # Applied, once the retried apply went through
    assert live(cluster, "policy/v1/poddisruptionbudgets", "flux")
    assert live(cluster, "v1/services", "flux")
    await request(cluster, "POST", PODS_PATH, workload_pod(cluster, "flux", 0, "gpu-0"))
    await request(cluster, "PATCH", f"{PODS_PATH}/flux-0/status", {"status": {
        "initContainerStatuses": [{"name": "loader", "restartCount": 0,
                                   "state": {"running": {}}}]}})
    await eventually(lambda: live(cluster, DOD_RESOURCE, "flux")["status"]["phase"] == "Loading")
    await request(cluster, "PATCH", f"{DOD_PATH}/flux", {"spec": {
        "disruptionBudget": {"enabled": False}, "inference": {"ports": None}}})
    await eventually(lambda: live(cluster, "policy/v1/poddisruptionbudgets", "flux") is None
                     and live(cluster, "v1/services", "flux") is None)
    await request(cluster, "PATCH", f"{DOD_PATH}/flux", {"spec": {"parallel": {"hsdp": True}}})
    await eventually(lambda: live(cluster, DOD_RESOURCE, "flux")["status"]["phase"] == "Failed")
    await request(cluster, "DELETE", f"{DOD_PATH}/flux")
    await eventually(lambda: live(cluster, DOD_RESOURCE, "flux") is None)
    await operator.stop()

    used = used_rules(cluster)
    expected = dict(used)
    for extra in (NOT_OBSERVABLE, AFTER_A_MODEL_CHANGE, AFTER_A_SIDECAR_PUBLISHED,
                  AFTER_A_CACHE_CLAIM, AFTER_A_REFUSED_POD, AFTER_A_REPLACED_DOD,
                  AFTER_THE_POLICY_TURNS_OFF):
        for rule, verbs in extra.items():
            expected[rule] = expected.get(rule, set()) | verbs
    assert expected == chart_rules()
