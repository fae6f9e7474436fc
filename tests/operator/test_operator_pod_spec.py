"""The pod spec is complete: every field a GPU inference chart offers is passed through, each
shown by `dlo render` (the same judgement and builders as the operator)."""

from __future__ import annotations

from typing import Any

import pytest

from dlo_operator.errors import SpecError
from dlo_operator.installation import InstallationConfig
from dlo_operator.manifests import fill_group
from dlo_operator.naming import Owner
from dlo_operator.render import render_document
from dlo_operator.spec import parse_spec

MINIMAL = {"model": {"source": "s3://models/flux/"}, "inference": {"image": "server:1"}}


def render(spec: dict[str, Any], **options: Any) -> dict[str, dict[str, Any]]:
    document = {"apiVersion": "dlo.dev/v1alpha1", "kind": "DiffusionOffloadDeployment",
                "metadata": {"name": "flux"}, "spec": {**MINIMAL, **spec}}
    return {f"{m['kind']}/{m['metadata']['name']}": m
            for m in render_document(document, "ml", **options)}


def pod(spec: dict[str, Any], **options: Any) -> dict[str, Any]:
    return render(spec, **options)["StatefulSet/flux"]["spec"]["template"]


def inference(spec: dict[str, Any]) -> dict[str, Any]:
    return pod(spec)["spec"]["containers"][0]


def test_image_pull_secrets_priority_and_runtime_class() -> None:
    template = pod({"imagePullSecrets": [{"name": "regcred"}],
                    "priorityClassName": "inference-high", "runtimeClassName": "nvidia"})
    assert template["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert (template["spec"]["priorityClassName"], template["spec"]["runtimeClassName"]) == (
        "inference-high", "nvidia")
    assert not {"imagePullSecrets", "priorityClassName", "runtimeClassName"} & set(
        pod({})["spec"])


def test_pod_labels_and_annotations_sit_beside_the_operators() -> None:
    template = pod({"podLabels": {"team": "ml"}, "podAnnotations": {"scrape": "true"}})
    assert template["metadata"]["labels"]["team"] == "ml"
    assert template["metadata"]["labels"]["dlo.dev/deployment"] == "flux"
    assert template["metadata"]["annotations"]["scrape"] == "true"
    assert "dlo.dev/settings-sha256" in template["metadata"]["annotations"]


def test_user_volumes_and_mounts() -> None:
    volume = {"name": "lora", "persistentVolumeClaim": {"claimName": "adapters"}}
    template = pod({"volumes": [volume], "inference": {
        "image": "server:1", "volumeMounts": [{"name": "lora", "mountPath": "/adapters"}]}})
    assert template["spec"]["volumes"][-1] == volume
    assert template["spec"]["containers"][0]["volumeMounts"][-1] == {
        "name": "lora", "mountPath": "/adapters"}


def test_startup_and_liveness_probes() -> None:
    probe = {"httpGet": {"path": "/health", "port": 8000}, "failureThreshold": 60}
    container = inference({"inference": {"image": "server:1", "startupProbe": probe,
                                         "livenessProbe": {"tcpSocket": {"port": 8000}}}})
    assert container["startupProbe"] == probe
    assert container["livenessProbe"] == {"tcpSocket": {"port": 8000}}
    assert not {"startupProbe", "livenessProbe", "readinessProbe"} & set(inference({}))


def test_shm_size_bounds_the_memory_backed_dev_shm() -> None:
    volumes = {v["name"]: v for v in pod({"shmSize": "16Gi"})["spec"]["volumes"]}
    assert volumes["dshm"] == {"name": "dshm", "emptyDir": {"medium": "Memory",
                                                             "sizeLimit": "16Gi"}}
    volumes = {v["name"]: v for v in pod({})["spec"]["volumes"]}
    assert volumes["dshm"] == {"name": "dshm", "emptyDir": {"medium": "Memory"}}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in inference({})["volumeMounts"]


def test_inference_ports_get_a_cluster_ip_service() -> None:
    children = render({"inference": {"image": "server:1", "ports": [
        {"name": "http", "containerPort": 8000}, {"containerPort": 9000, "protocol": "UDP"}]}})
    assert children["Service/flux"]["spec"] == {
        "type": "ClusterIP",
        "selector": children["StatefulSet/flux"]["spec"]["selector"]["matchLabels"],
        "ports": [{"name": "http", "port": 8000, "targetPort": 8000, "protocol": "TCP"},
                  {"name": "port-9000", "port": 9000, "targetPort": 9000, "protocol": "UDP"}]}
    assert "Service/flux" not in render({})


@pytest.mark.parametrize(("value", "rendered"), [("1", 1), ("25%", "25%")])
def test_an_optional_pod_disruption_budget(value: str, rendered: int | str) -> None:
    children = render({"disruptionBudget": {"enabled": True, "maxUnavailable": value}})
    budget = children["PodDisruptionBudget/flux"]
    assert budget["apiVersion"] == "policy/v1"
    assert budget["spec"] == {"maxUnavailable": rendered, "selector": children[
        "StatefulSet/flux"]["spec"]["selector"]}
    assert not [key for key in render({}) if key.startswith("PodDisruptionBudget")]


def test_the_loader_image_defaults_to_the_operators_and_the_dod_may_name_an_allowed_one() -> None:
    def loader_image(spec: dict[str, Any], **options: Any) -> str:
        installation = InstallationConfig(**options)
        return pod(spec, installation=installation)["spec"]["initContainers"][0]["image"]
    assert loader_image({}) == "dlo-loader:0.1.0"
    assert loader_image({}, loader_image="registry.example.com/dlo-loader:2") == (
        "registry.example.com/dlo-loader:2")
    assert loader_image({"loader": {"image": "mine:1"}}, loader_image="other:2",
                        allowed_loader_images=("mine:1",)) == "mine:1"
    assert loader_image({"loader": {"image": "other:2"}}, loader_image="other:2") == "other:2"


def test_the_rendezvous_address_needs_no_cluster_domain() -> None:
    owner = Owner(name="flux", namespace="ml", uid="u")
    group = fill_group(owner, parse_spec({**MINIMAL, "replicas": 2}), range(2))
    assert group.master_addr == "flux-0.flux-peers.ml.svc"
    assert owner.prefill_master_addr("abc") == "flux-prefill-abc-0.flux-prefill.ml.svc"


@pytest.mark.parametrize(("spec", "message"), [
    ({"podLabels": {"dlo.dev/deployment": "other"}},
     "[pod-labels-reserved] spec.podLabels sets dlo.dev/deployment, which the operator uses to "
     "select the DOD's pods; remove them"),
    ({"volumes": [{"name": "node-cache", "emptyDir": {}}]},
     "[volume-names] spec.volumes names 'node-cache' more than once or as one of the operator's "
     "own volumes (settings, run, loader-tmp, node-cache, dshm, source-credentials, "
     "fill-secret); rename "
     "them"),
    ({"offload": {"useAllgather": False, "enableRuntimeCache": True}, "cache": {
        "hostPath": "/var/lib/dlo"}},
     "[runtime-cache-apart] spec.offload.runtimeCacheRoot='/var/lib/dlo/runtime' (the default "
     "of an empty runtimeCacheRoot) and spec.cache.hostPath='/var/lib/dlo' overlap; the entries "
     "are read-only in the inference container and its runtime cache is writable: set "
     "spec.offload.runtimeCacheRoot to a path that neither contains nor lies inside "
     "spec.cache.hostPath"),
    ({"offload": {"useAllgather": False, "enableRuntimeCache": True,
                  "runtimeCacheRoot": "/var/lib/dlo/cache"}},
     "[runtime-cache-apart] spec.offload.runtimeCacheRoot='/var/lib/dlo/cache' and "
     "spec.cache.hostPath='/var/lib/dlo/cache' overlap; the entries are read-only in the "
     "inference container and its runtime cache is writable: set spec.offload.runtimeCacheRoot "
     "to a path that neither contains nor lies inside spec.cache.hostPath"),
    ({"inference": {"image": "s:1", "volumeMounts": [{"name": "x", "mountPath": "/x"}]}},
     "[volume-mounts-known] spec.inference.volumeMounts mounts 'x', which spec.volumes does "
     "not define; add the volume or remove the mount"),
    ({"loader": {"port": 9400}},
     "[pod-ports-distinct] spec.loader.port and spec.loader.metricsPort are both 9400; the "
     "pod's containers share one network, so one of them could not bind it: choose distinct "
     "ports"),
    ({"inference": {"image": "s:1", "ports": [{"containerPort": 8000},
                                              {"name": "m", "containerPort": 29500}]}},
     "[pod-ports-distinct] spec.loader.port and spec.inference.ports[1].containerPort are both "
     "29500; the pod's containers share one network, so one of them could not bind it: choose "
     "distinct ports"),
    ({"inference": {"image": "s:1", "ports": [{"name": "http"}]}},
     "spec.inference.ports[0]: 'containerPort' is a required property (core/v1 ContainerPort, "
     "as the API server checks it)"),
    ({"inference": {"image": "s:1", "ports": [{"containerPort": "8000"}]}},
     "spec.inference.ports[0].containerPort: '8000' is not of type 'integer' (core/v1 "
     "ContainerPort, as the API server checks it)"),
    ({"inference": {"image": "s:1", "ports": [{"containerPort": 70000}]}},
     "[inference-ports-valid] spec.inference.ports[0].containerPort=70000 is not a port "
     "number; set an integer from 1 to 65535"),
    ({"inference": {"image": "s:1", "ports": [
        {"containerPort": 8000}, {"name": "inference-metrics", "containerPort": 9000}]}},
     "[inference-ports-valid] spec.inference.ports[1].name='inference-metrics' is not a port "
     "name; use at most 15 lowercase letters, digits and '-', with a letter, no '-' at either "
     "end and no '--'"),
    ({"inference": {"image": "s:1", "ports": [{"name": "HTTP", "containerPort": 8000}]}},
     "[inference-ports-valid] spec.inference.ports[0].name='HTTP' is not a port name; use at "
     "most 15 lowercase letters, digits and '-', with a letter, no '-' at either end and no "
     "'--'"),
    ({"inference": {"image": "s:1", "ports": [{"name": "http", "containerPort": 8000},
                                              {"name": "http", "containerPort": 8001}]}},
     "[inference-ports-valid] spec.inference.ports[1].name='http' is also "
     "spec.inference.ports[0].name; give each port its own name"),
    ({"inference": {"image": "s:1", "ports": [{"containerPort": 8000, "protocol": "tcp"}]}},
     "[inference-ports-valid] spec.inference.ports[0].protocol='tcp' is not one of TCP, UDP, "
     "SCTP; use one of them"),
    ({"volumes": [{"name": "x", "emptyDir": {}}], "inference": {
        "image": "s:1", "volumeMounts": [{"name": "x", "mountPath": "/var/lib/dlo"}]}},
     "spec.cache.hostPath='/var/lib/dlo/cache' overlaps the container mount path "
     "'/var/lib/dlo'; choose a directory that neither contains nor lies inside it"),
])
def test_contradictions_in_the_pod_are_refused(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError) as info:
        render(spec)
    assert str(info.value) == f"ml/flux: {message}"


def test_gpus_per_pod_agrees_with_the_users_limit_and_the_ranks() -> None:
    container = inference({"gpusPerPod": 8, "parallel": {"dp": 8}, "inference": {
        "image": "s:1", "resources": {"limits": {"nvidia.com/gpu": "8"}}}})
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
    with pytest.raises(SpecError, match=r"\[gpus-per-pod-resources\] spec.inference.resources"
                                        r".limits\['nvidia.com/gpu'\]='4' contradicts "
                                        r"spec.gpusPerPod=8"):
        render({"gpusPerPod": 8, "parallel": {"dp": 8}, "inference": {
            "image": "s:1", "resources": {"limits": {"nvidia.com/gpu": "4"}}}})
