"""One table of DiffusionOffloadDeployments the system must refuse: the names, paths, URIs and
typos a platform engineer writes, every row of the DLO compatibility matrix, and the pod-level
contradictions. Each row names what the refusal message must contain, and whether the CRD
(schema + CEL, at `kubectl apply`) refuses it too or only the operator and `dlo render` do
(an installation's host-path allowlist, or a comparison of free-form core/v1 resources)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

NAMESPACE = "inference"
GOOD_SPEC: dict[str, Any] = {"replicas": 2, "model": {"source": "s3://models/flux/"},
                             "inference": {"image": "server:1"}}
RANK_LOCAL = {"useAllgather": False, "enableRuntimeCache": True}


@dataclass(frozen=True)
class BadCR:
    id: str
    spec: dict[str, Any] = field(default_factory=dict)
    """Merged into GOOD_SPEC (nested objects merged, values replaced)."""
    expect: str = ""
    """A fragment of the refusal message."""
    crd: bool = True
    """False: the CRD accepts it; only the operator and `dlo render` refuse it."""
    name: str = ""
    """metadata.name; empty derives a valid one from the id."""

    def document(self) -> dict[str, Any]:
        return {"apiVersion": "dlo.dev/v1alpha1", "kind": "DiffusionOffloadDeployment",
                "metadata": {"name": self.name or f"bad-{self.id}"[:52].rstrip("-"),
                             "namespace": NAMESPACE},
                "spec": _merged(GOOD_SPEC, self.spec)}


def _merged(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in patch.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(
            out.get(key), dict) else value
    return out


NAME_RULE = "[name-dns-1035]"
ROWS: tuple[BadCR, ...] = (
    # Names: a dot or a leading digit is no Service name; 53+ characters break the
    # controller-revision-hash label (pods are never created).
    BadCR("name-dot", name="flux.dev", expect=NAME_RULE),
    BadCR("name-digit", name="9flux", expect=NAME_RULE),
    BadCR("name-upper", name="Flux", expect=NAME_RULE),
    BadCR("name-53", name="f" * 53, expect=NAME_RULE),
    # Object-store URIs.
    BadCR("source-no-bucket", {"model": {"source": "s3://"}}, "spec.model.source: 's3://'"),
    BadCR("source-empty-bucket", {"model": {"source": "s3:///x/"}},
          "spec.model.source: 's3:///x/' does not match"),
    BadCR("source-http", {"model": {"source": "http://x"}}, "spec.model.source: 'http://x'"),
    BadCR("source-hf-no-repo", {"model": {"source": "hf://org"}},
          "spec.model.source: 'hf://org' does not match"),
    BadCR("source-file-dot-dot", {"model": {"source": "file:///models/../etc/"}},
          "spec.model.source: 'file:///models/../etc/' does not match"),
    BadCR("source-az-upper-account",
          {"model": {"source": "https://Acct.blob.core.windows.net/c/p/"}},
          "spec.model.source='https://Acct.blob.core.windows.net/c/p/' must be az://account/"
          "container/prefix/ or https://account.blob.core.windows.net/container/prefix/ "
          "(account in lower case)", crd=False),
    BadCR("source-share", {"model": {"source": "file:///models/m/"}}, "[source-share]"),
    BadCR("source-share-volume", {"model": {"source": "file:///models/m/",
                                            "share": {"volumeName": "w"}}},
          "[source-share-volume] spec.model.share.volumeName='w' is not one of spec.volumes",
          crd=False),
    # Typos are refused, not pruned (`kubectl apply` validates fields strictly).
    BadCR("typo-replica", {"replica": 3}, "spec.replica: unknown field"),
    BadCR("typo-nested", {"offload": {"useAllGather": False}},
          "spec.offload.useAllGather: unknown field"),
    # Host paths.
    BadCR("host-path-relative", {"cache": {"hostPath": "cache"}}, "spec.cache.hostPath: 'cache'"),
    BadCR("host-path-root", {"cache": {"hostPath": "/"}}, "spec.cache.hostPath: '/'"),
    BadCR("host-path-dotdot", {"cache": {"hostPath": "/var/lib/../../etc"}},
          "spec.cache.hostPath: '/var/lib/../../etc'"),
    BadCR("host-path-trailing-slash", {"cache": {"hostPath": "/var/lib/dlo/cache/"}},
          "spec.cache.hostPath: '/var/lib/dlo/cache/'"),
    # cache.hostPath and runtimeCacheRoot are paths in the containers (the node directory is
    # the platform's): they may not hide a mount of the containers' own, nor overlap each other.
    BadCR("host-path-etc", {"cache": {"hostPath": "/etc"}},
          "spec.cache.hostPath='/etc' overlaps the container mount path '/etc/dlo'", crd=False),
    BadCR("runtime-root-relative", {"offload": {**RANK_LOCAL, "runtimeCacheRoot": "rt"}},
          "spec.offload.runtimeCacheRoot: 'rt'"),
    BadCR("runtime-root-hides-settings", {"offload": {**RANK_LOCAL,
                                                      "runtimeCacheRoot": "/etc/dlo"}},
          "spec.offload.runtimeCacheRoot='/etc/dlo' overlaps the container mount path "
          "'/etc/dlo'", crd=False),
    BadCR("runtime-root-nested", {"offload": {
        **RANK_LOCAL, "runtimeCacheRoot": "/var/lib/dlo/cache/runtime"}},
        "[runtime-cache-apart] spec.offload.runtimeCacheRoot='/var/lib/dlo/cache/runtime' and "
        "spec.cache.hostPath='/var/lib/dlo/cache' overlap", crd=False),
    # Bounds.
    BadCR("dp-zero", {"parallel": {"dp": 0}}, "spec.parallel.dp: 0 is less than the minimum of 1"),
    BadCR("cfg-parallel-3", {"parallel": {"cfgParallel": 3}},
          "spec.parallel.cfgParallel: 3 is not one of [1, 2]"),
    BadCR("replicas-zero", {"replicas": 0}, "spec.replicas: 0 is less than the minimum of 1"),
    # The compatibility matrix of the DLO design, one row per rule.
    BadCR("hsdp-allgather", {"parallel": {"hsdp": True}}, "[hsdp-allgather]"),
    BadCR("resident-layers-allgather", {"offload": {"residentLayers": 2}},
          "[resident-layers-allgather]"),
    BadCR("quantization-allgather", {"quantization": "int8_weight_only"},
          "[quantization-allgather]"),
    BadCR("runtime-cache-allgather", {"offload": {"enableRuntimeCache": True}},
          "[runtime-cache-allgather]"),
    BadCR("runtime-cache-quantization", {"offload": RANK_LOCAL, "quantization": "fp8_per_tensor"},
          "[runtime-cache-quantization]"),
    BadCR("runtime-cache-hsdp", {"offload": RANK_LOCAL, "parallel": {"hsdp": True}},
          "[runtime-cache-hsdp]"),
    BadCR("runtime-cache-ep", {"offload": RANK_LOCAL, "parallel": {"ep": 2}},
          "[runtime-cache-ep]"),
    BadCR("runtime-cache-cfg-parallel", {"offload": RANK_LOCAL, "parallel": {"cfgParallel": 2}},
          "[runtime-cache-cfg-parallel]"),
    BadCR("runtime-cache-pp", {"offload": RANK_LOCAL, "parallel": {"pp": 4}},
          "[runtime-cache-pp]"),
    BadCR("pin-limit-needs-runtime-cache", {"offload": {"runtimeCachePinLimitGiB": 0.5}},
          "[pin-limit-needs-runtime-cache]"),
    BadCR("hsdp-with-dp-or-tp", {"offload": {"useAllgather": False},
                                 "parallel": {"hsdp": True, "dp": 2}}, "[hsdp-with-dp-or-tp]"),
    BadCR("loader-memory-two-chunks", {"loader": {"chunkBytes": 1 << 30}},
          "[loader-memory-two-chunks]"),
    # The pod against the settings.
    BadCR("loader-backend-gloo", {"loader": {"backend": "nccl"}}, "[loader-backend-gloo]"),
    BadCR("gpus-per-pod-resources", {"gpusPerPod": 1, "inference": {
        "resources": {"limits": {"nvidia.com/gpu": 2}}}}, "[gpus-per-pod-resources]", crd=False),
    BadCR("gpus-per-pod-ranks", {"gpusPerPod": 4, "parallel": {"dp": 8}},
          "[gpus-per-pod-ranks] spec.parallel dp=8 x sp=1 x tp=1 x cfgParallel=1 x pp=1 = 8 "
          "ranks per pod, but spec.gpusPerPod=4", crd=False),
    BadCR("loader-memory-container-limit", {"loader": {
        "memoryLimitBytes": 8 << 30, "resources": {"limits": {"memory": "4Gi"}}}},
        "[loader-memory-container-limit] spec.loader.memoryLimitBytes=8589934592 does not fit",
        crd=False),
    # The core/v1 objects the DOD passes to its children, refused as the API server would
    # refuse the StatefulSet or the PodDisruptionBudget (issue 35): named in the DOD's words.
    BadCR("label-key", {"podLabels": {"team name": "ml"}},
          "[labels-valid] spec.podLabels key 'team name' is not a qualified name", crd=False),
    BadCR("label-value", {"podLabels": {"team": "machine learning"}},
          "[labels-valid] spec.podLabels['team']='machine learning' is not a label value",
          crd=False),
    BadCR("node-selector-key", {"nodeSelector": {"-gpu": "true"}},
          "[labels-valid] spec.nodeSelector key '-gpu' is not a qualified name", crd=False),
    BadCR("priority-class-name", {"priorityClassName": "High_Priority"},
          "[dns-subdomain] spec.priorityClassName='High_Priority' is not an object name",
          crd=False),
    BadCR("service-account-name", {"serviceAccountName": "model reader"},
          "[dns-subdomain] spec.serviceAccountName='model reader' is not an object name",
          crd=False),
    BadCR("toleration-operator", {"tolerations": [{"key": "gpu", "operator": "Sometimes"}]},
          "[tolerations-valid] spec.tolerations[0].operator='Sometimes' is not one of Equal, "
          "Exists", crd=False),
    BadCR("toleration-seconds-type", {"tolerations": [{"key": "gpu", "operator": "Exists",
                                                       "effect": "NoExecute",
                                                       "tolerationSeconds": "1h"}]},
          "spec.tolerations[0].tolerationSeconds: '1h' is not of type 'integer'", crd=False),
    BadCR("probe-no-handler", {"inference": {"readinessProbe": {"periodSeconds": 10}}},
          "[probe-handler] spec.inference.readinessProbe needs exactly one of exec, httpGet, "
          "tcpSocket, grpc (it has none)", crd=False),
    BadCR("probe-unknown-field", {"inference": {"livenessProbe": {"httpGet": {"port": 8000},
                                                                  "periodSecond": 5}}},
          "spec.inference.livenessProbe: Additional properties are not allowed ('periodSecond' "
          "was unexpected)", crd=False),
    BadCR("pdb-percent", {"disruptionBudget": {"enabled": True, "maxUnavailable": "150%"}},
          "spec.disruptionBudget.maxUnavailable: '150%' does not match"),
    BadCR("mount-run-dlo", {"volumes": [{"name": "s", "emptyDir": {}}], "inference": {
        "volumeMounts": [{"name": "s", "mountPath": "/run/dlo"}]}},
          "[volume-mounts-paths] spec.inference.volumeMounts[0].mountPath='/run/dlo' is where "
          "dlo mounts its own volume '/run/dlo'", crd=False),
    BadCR("mount-path-twice", {"volumes": [{"name": "a", "emptyDir": {}},
                                           {"name": "b", "emptyDir": {}}], "inference": {
        "volumeMounts": [{"name": "a", "mountPath": "/data"},
                         {"name": "b", "mountPath": "/data"}]}},
          "[volume-mounts-paths] spec.inference.volumeMounts[1].mountPath='/data' is also "
          "spec.inference.volumeMounts[0].mountPath", crd=False),
    BadCR("quantity-cpu", {"inference": {"resources": {"requests": {"cpu": "lots"}}}},
          "[resource-quantity] spec.inference.resources.requests['cpu']='lots' is not a "
          "quantity", crd=False),
    BadCR("quantity-request-over-limit", {"loader": {"resources": {
        "requests": {"memory": "8Gi"}, "limits": {"memory": "4Gi"}}}},
          "[resource-quantity] spec.loader.resources.requests['memory']='8Gi' exceeds its limit "
          "'4Gi'", crd=False),
    BadCR("env-no-name", {"inference": {"env": [{"value": "1"}]}},
          "spec.inference.env[0]: 'name' is a required property", crd=False),
    BadCR("affinity-malformed", {"affinity": {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": [{"key": "gpu"}]}}},
          "spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution: "
          "[{'key': 'gpu'}] is not of type 'object'", crd=False),
    BadCR("affinity-operator", {"affinity": {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "gpu", "operator": "Within", "values": ["a"]}]}]}}}},
          "[affinity-valid] spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuring"
          "Execution.nodeSelectorTerms[0].matchExpressions[0].operator='Within' is not one of "
          "In, NotIn, Exists, DoesNotExist, Gt, Lt", crd=False),
    BadCR("volume-name", {"volumes": [{"name": "Data", "emptyDir": {}}]},
          "[volumes-valid] spec.volumes[0].name='Data' is not a DNS label", crd=False),
    # The platform's choices with the chart's defaults (issue 33; other values:
    # tests/operator/test_operator_platform_limits.py): no host path, only the chart's loader.
    BadCR("user-host-path-root", {"volumes": [{"name": "h", "hostPath": {"path": "/"}}],
                                  "inference": {"volumeMounts": [{"name": "h",
                                                                  "mountPath": "/host"}]}},
          "spec.volumes[0].hostPath.path='/' is not under a node directory the platform lets "
          "DODs mount (chart value allowedUserHostPaths; none is allowed)", crd=False),
    BadCR("user-host-path-kubelet", {"volumes": [{"name": "k", "hostPath": {
        "path": "/var/lib/kubelet"}}]},
          "spec.volumes[0].hostPath.path='/var/lib/kubelet' is not under a node directory",
          crd=False),
    BadCR("user-git-repo", {"volumes": [{"name": "g", "gitRepo": {"repository": "x"}}]},
          "spec.volumes[0].gitRepo is refused", crd=False),
    BadCR("loader-image-other", {"loader": {"image": "evil.example.com/miner:latest"}},
          "spec.loader.image='evil.example.com/miner:latest' is not a loader image the platform "
          "allows (chart values loaderImage and allowedLoaderImages: dlo-loader:0.1.0)",
          crd=False),
)
