"""The operator as the node cache's provisioner, against the API emulator: a DOD's pod claims
the node cache (the test stands in for the ephemeral-volume controller and the scheduler), the
operator serves the claim with its namespace's directory on the chosen node, bound to that claim
alone, and deletes the volume once the claim is gone. Attack 4 of issue 33 (a server reading
another namespace's entries) needs two namespaces to share a directory: they never do."""

from __future__ import annotations

from typing import Any

import kmock
import pytest

from dlo_operator import provisioner
from dlo_operator.errors import KubeTransientError
from dlo_operator.node_cache import (
    NODE_ANNOTATION,
    NODE_CACHE_CLASS,
    SELECTED_NODE,
    NodeCacheConfig,
    build_persistent_volume,
    pending_claim,
)
from support.operator_harness import (
    DOD_PATH,
    NAMESPACE,
    ClusterEmulator,
    Operator,
    eventually,
    live,
    request,
    used_rules,
)

PV_RESOURCE = "v1/persistentvolumes"
PROVISIONER_RULES = {"persistentvolumes": {"get", "list", "watch", "create", "delete"},
                     "persistentvolumeclaims": {"get", "list", "watch"}, "nodes": {"get"}}
"""What the chart grants the provisioner (tests/chart/test_chart.py checks the chart says so)."""


def claims_path(namespace: str) -> str:
    return f"/api/v1/namespaces/{namespace}/persistentvolumeclaims"


def volume(cluster: ClusterEmulator, name: str) -> dict[str, Any] | None:
    key = (kmock.resource(PV_RESOURCE), None, name)
    if key not in cluster.objects or cluster.objects[key].deleted:
        return None
    return cluster.objects[key].raw


def volumes(cluster: ClusterEmulator) -> list[dict[str, Any]]:
    return [obj.raw for (resource, _, _), obj in list(cluster.objects.items())
            if resource == kmock.resource(PV_RESOURCE) and not obj.deleted]


async def add_node(cluster: ClusterEmulator, name: str, hostname: str) -> None:
    await request(cluster, "POST", "/api/v1/nodes", {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": hostname}}})


def pod_owner(claim_name: str) -> list[dict[str, Any]]:
    """What the ephemeral-volume controller writes on a pod's claim `<pod>-node-cache`."""
    return [{"apiVersion": "v1", "kind": "Pod", "name": claim_name.removesuffix("-node-cache"),
             "uid": f"pod-uid-{claim_name}", "controller": True, "blockOwnerDeletion": True}]


async def claim(cluster: ClusterEmulator, namespace: str, name: str, spec: dict[str, Any],
                node: str, owners: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The ephemeral-volume controller creates the pod's claim, owned by the pod (`owners`:
    another owner, or none, for a claim a tenant made); the scheduler then annotates it with
    the node it chose (WaitForFirstConsumer)."""
    created = await request(cluster, "POST", claims_path(namespace), {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": name, "namespace": namespace,
                     "ownerReferences": pod_owner(name) if owners is None else owners},
        "spec": spec})
    await request(cluster, "PATCH", f"{claims_path(namespace)}/{name}", {
        "metadata": {"annotations": {SELECTED_NODE: node}}})
    return created


async def pod_claim_spec(cluster: ClusterEmulator) -> dict[str, Any]:
    """The claim template of the DOD's pods, as the operator rendered it."""
    await request(cluster, "POST", DOD_PATH, {
        "apiVersion": "dlo.dev/v1alpha1", "kind": "DiffusionOffloadDeployment",
        "metadata": {"name": "flux", "namespace": NAMESPACE},
        "spec": {"model": {"source": "s3://models/flux/"}, "inference": {"image": "server:1"}}})
    sts = await eventually(lambda: live(cluster, "apps/v1/statefulsets", "flux"))
    [template] = [v["ephemeral"]["volumeClaimTemplate"]
                  for v in sts["spec"]["template"]["spec"]["volumes"] if "ephemeral" in v]
    assert "hostPath" not in str(sts["spec"]["template"]["spec"]["volumes"])
    return dict(template["spec"])


PENDING = {"metadata": {"name": "flux-0-node-cache", "namespace": "team-a", "uid": "u-1",
                        "annotations": {SELECTED_NODE: "gpu-0"},
                        "ownerReferences": pod_owner("flux-0-node-cache")},
           "spec": {"storageClassName": NODE_CACHE_CLASS, "accessModes": ["ReadWriteOncePod"],
                    "resources": {"requests": {"storage": "1Gi"}}}}


@pytest.mark.parametrize(("change", "served"), [
    ({}, True),
    ({"spec": {"storageClassName": "standard"}}, False),
    ({"metadata": {"annotations": {}}}, False),
    ({"spec": {"volumeName": "pv-1"}}, False),
    ({"metadata": {"deletionTimestamp": "2026-01-01T00:00:00Z"}}, False),
    ({"spec": {"volumeMode": "Block"}}, False),
    ({"metadata": {"ownerReferences": []}}, False),
    ({"metadata": {"ownerReferences": [{**pod_owner("flux-0-node-cache")[0],
                                        "controller": False}]}}, False),
    ({"metadata": {"ownerReferences": [{**pod_owner("flux-0-node-cache")[0],
                                        "kind": "StatefulSet", "apiVersion": "apps/v1"}]}},
     False),
    ({"metadata": {"ownerReferences": pod_owner("other-node-cache")}}, False),
], ids=["pending", "other-class", "no-node-yet", "bound", "deleting", "block", "no-owner",
        "pod-not-controller", "not-a-pod", "another-pods-name"])
def test_only_a_scheduled_unbound_node_cache_claim_is_served(change: dict[str, Any],
                                                              served: bool) -> None:
    pvc = {key: {**PENDING[key], **change.get(key, {})} for key in PENDING}
    assert (pending_claim(pvc) is not None) == served


def test_a_claim_no_pod_controls_is_named_in_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    """Its own pod stays Pending: the operator's log says why."""
    mine = {"metadata": {**PENDING["metadata"], "name": "mine", "ownerReferences": []},
            "spec": PENDING["spec"]}
    assert provisioner.serve_claim(None, mine, NodeCacheConfig()) is None  # type: ignore[arg-type]
    assert caplog.messages == [
        "claim team-a/mine of class dlo-node-cache is not served: only a pod's own ephemeral "
        "claim is (its controller the pod it is named after); use an ephemeral volume in the "
        "pod, or another StorageClass"]


def test_nothing_a_tenant_writes_reaches_the_node_directory() -> None:
    """The claim's name, annotations and labels are the tenant's; only its namespace and the
    platform's root decide the directory."""
    tampered = {"metadata": {**PENDING["metadata"], "name": "flux-0-../../etc",
                             "labels": {"dlo.dev/path": "/"},
                             "annotations": {SELECTED_NODE: "gpu-0", "dlo.dev/path": "/"}},
                "spec": PENDING["spec"]}
    claim = pending_claim(tampered)
    assert claim is not None
    pv = build_persistent_volume(claim, "gpu-0", NodeCacheConfig(root="/mnt/nvme/dlo"))
    assert pv["spec"]["hostPath"]["path"] == "/mnt/nvme/dlo/namespaces/team-a"


def test_a_busy_api_server_is_retried_with_backoff_then_given_up() -> None:
    waits: list[float] = []
    answers = iter([KubeTransientError("busy", delay_s=0.0), None])

    def step() -> None:
        answer = next(answers)
        if answer is not None:
            raise answer
    provisioner.with_retries(step, "claim team-a/c", waits.append)
    assert waits == [1.0]

    def always_busy() -> None:
        raise KubeTransientError("busy", delay_s=3.0)
    waits.clear()
    provisioner.with_retries(always_busy, "claim team-a/c", waits.append)
    assert waits == [3.0, 3.0, 4.0]


async def test_a_pods_claim_gets_its_namespaces_directory_on_its_node_until_it_is_deleted(
        cluster: ClusterEmulator, operator: Operator) -> None:
    await add_node(cluster, "gpu-0", "gpu-0.example")
    spec = await pod_claim_spec(cluster)
    assert spec["storageClassName"] == NODE_CACHE_CLASS
    created = await claim(cluster, NAMESPACE, "flux-0-node-cache", spec, "gpu-0")
    uid = created["metadata"]["uid"]
    pv = await eventually(lambda: volume(cluster, f"dlo-node-cache-{uid}"))
    assert pv["spec"]["hostPath"] == {"path": f"/var/lib/dlo/namespaces/{NAMESPACE}",
                                      "type": "Directory"}
    assert pv["metadata"]["annotations"][NODE_ANNOTATION] == "gpu-0"  # its node's agent
    assert pv["spec"]["claimRef"] == {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "namespace": NAMESPACE,
        "name": "flux-0-node-cache", "uid": uid}
    assert pv["spec"]["nodeAffinity"] == {"required": {"nodeSelectorTerms": [{
        "matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In",
                              "values": ["gpu-0.example"]}]}]}}
    assert (pv["spec"]["storageClassName"], pv["spec"]["persistentVolumeReclaimPolicy"],
            pv["spec"]["capacity"], pv["spec"]["accessModes"]) == (
        NODE_CACHE_CLASS, "Delete", spec["resources"]["requests"], ["ReadWriteOncePod"])

    await request(cluster, "DELETE", f"{claims_path(NAMESPACE)}/flux-0-node-cache")
    await eventually(lambda: volume(cluster, f"dlo-node-cache-{uid}") is None)
    used = {(resource, verb) for (_, resource), verbs in used_rules(cluster).items()
            if resource.split("/")[0] in PROVISIONER_RULES for verb in verbs}
    assert {("persistentvolumes", "create"), ("persistentvolumes", "delete"),
            ("nodes", "get")} <= used
    assert all(verb in PROVISIONER_RULES.get(resource, ()) for resource, verb in used), used


async def test_two_namespaces_on_one_node_get_two_directories_and_other_classes_none(
        cluster: ClusterEmulator, operator: Operator) -> None:
    """A claim of another class, and claims of the node cache's class that no pod owns (a
    tenant's own, which would outlive its pods and serve any of them), get no volume."""
    await add_node(cluster, "gpu-0", "gpu-0")
    spec = await pod_claim_spec(cluster)
    other_class = await claim(cluster, NAMESPACE, "scratch",
                              {**spec, "storageClassName": "standard"}, "gpu-0")
    unowned = [await claim(cluster, NAMESPACE, "mine-node-cache", spec, "gpu-0", owners=[]),
               await claim(cluster, NAMESPACE, "x-node-cache", spec, "gpu-0",
                           owners=pod_owner("flux-0-node-cache"))]
    ours = await claim(cluster, NAMESPACE, "flux-0-node-cache", spec, "gpu-0")
    theirs = await claim(cluster, "team-b", "sd3-0-node-cache", spec, "gpu-0")
    paths = {}
    for created in (ours, theirs):
        uid = created["metadata"]["uid"]
        pv = await eventually(lambda: volume(cluster, f"dlo-node-cache-{uid}"))  # noqa: B023
        paths[created["metadata"]["namespace"]] = pv["spec"]["hostPath"]["path"]
    assert paths == {NAMESPACE: f"/var/lib/dlo/namespaces/{NAMESPACE}",
                     "team-b": "/var/lib/dlo/namespaces/team-b"}
    runner = await operator.stop()
    assert runner.exit_code == 0
    served = sorted(pv["spec"]["claimRef"]["uid"] for pv in volumes(cluster))
    assert served == sorted([ours["metadata"]["uid"], theirs["metadata"]["uid"]])
    assert other_class["metadata"]["uid"] not in served
    assert not {c["metadata"]["uid"] for c in unowned} & set(served)


async def test_a_volume_whose_claim_went_while_the_operator_was_away_is_deleted(
        cluster: ClusterEmulator) -> None:
    """A claim deleted, or deleted and created again under its name (another uid), while no
    operator ran: its volume must never serve the new claim, and goes at the operator's start."""
    await add_node(cluster, "gpu-0", "gpu-0")
    renewed = await request(cluster, "POST", claims_path(NAMESPACE), {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": "flux-1-node-cache", "namespace": NAMESPACE},
        "spec": {"storageClassName": "standard", "accessModes": ["ReadWriteOnce"],
                 "resources": {"requests": {"storage": "1Gi"}}}})
    for name, uid in (("flux-0-node-cache", "gone"), ("flux-1-node-cache", "old-uid")):
        await request(cluster, "POST", "/api/v1/persistentvolumes", {
            "apiVersion": "v1", "kind": "PersistentVolume",
            "metadata": {"name": f"dlo-node-cache-{uid}", "labels": {"dlo.dev/node-cache": "true"}},
            "spec": {"claimRef": {"namespace": NAMESPACE, "name": name, "uid": uid},
                     "storageClassName": NODE_CACHE_CLASS,
                     "hostPath": {"path": f"/var/lib/dlo/namespaces/{NAMESPACE}"}}})
    assert renewed["metadata"]["uid"] != "old-uid"
    operator = Operator()
    await operator.start()
    try:
        await eventually(lambda: volumes(cluster) == [])
    finally:
        await operator.stop()
