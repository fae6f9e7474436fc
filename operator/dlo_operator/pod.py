"""The workload pod template: loader sidecar, inference container, volumes, scheduling.

The loader is a native sidecar (an init container with `restartPolicy: Always`, Kubernetes 1.29
and later): the kubelet starts the inference container right after it, so the server's imports
and pipeline construction overlap the fill, and the runtime waits for the entry document
(`DLO_ENTRY_WAIT_SECONDS`, the fill's deadline). The loader stays up after publishing
(`--keep-running`) and runs at a lower CPU priority than the server's start (`--yield-cpu`); its
readiness probe says the entry document exists, which is how the status tells a node that holds
the checkpoint (`status.LoaderState.CACHED`). A failed fill exits, and the kubelet restarts it
with back-off while the runtime keeps waiting.

Contract C2 (the loader's command line and environment) and contract C3 (the inference
container's `DLO_*` environment and mounts) are written here and nowhere else. Nothing in the
template depends on the replica count: a workload loader learns its fill group from the
fill-group document (`DLO_FILL_GROUP`, an optional ConfigMap key) and its own pod name, so scaling
restarts no pod. `loader_container` is shared with the prefill Job. Pure; called by
`statefulset.build_statefulset` and `prefill`. It must not decide names or labels (see `naming`).

No volume here is a hostPath: the node cache is the pod's ephemeral claim (`node_cache`, see
[Note: the node cache's tenant boundary] there), so every pod passes Pod Security `baseline`, and
the loader `restricted`. The loader mounts its namespace's entries writable at `cache.hostPath` (a
path in the containers); the inference container mounts them read-only there, and with the
runtime cache its own DOD's directory writable at `offload.runtimeCacheRoot`, which never overlaps
the entries.
"""

from __future__ import annotations

import copy
from typing import Any

from dlo_contract.fill_group import FILL_GROUP_KEY
from dlo_contract.names import (
    CONFIG_ENV,
    DEFAULT_CONFIG_PATH,
    DEFAULT_ENTRY_FILE,
    DEFAULT_FILL_SECRET_FILE,
    ENTRY_FILE_ENV,
    ENTRY_WAIT_ENV,
    FILL_GROUP_ENV,
    FILL_SECRET_ENV,
    FILL_SECRET_KEY,
    FILL_SECRET_MOUNT,
    LOADER_METRICS_PORT_NAME,
    NODE_NAME_ENV,
    POD_NAME_ENV,
    REVISION_ENV,
    RUN_DIR,
    SETTINGS_MOUNT,
)
from dlo_operator.naming import (
    INFERENCE_CONTAINER,
    LOADER_CONTAINER,
    LOADER_TMP,
    SETTINGS_KEY,
    SHM_PATH,
    Owner,
    selector_labels,
)
from dlo_operator.node_cache import (
    CACHE_SUBPATH,
    CACHE_VOLUME,
    build_cache_volume,
    runtime_subpath,
)
from dlo_operator.source_access import (
    CREDENTIALS_VOLUME,
    credential_env,
    source_mounts,
    source_volumes,
)
from dlo_operator.spec import DeploymentSpec, runtime_cache_on

GPU_RESOURCE = "nvidia.com/gpu"
SHM_VOLUME = "dshm"
FILL_SECRET_VOLUME = "fill-secret"
"""The DOD's fill Secret (`fill_secret`), mounted in the loader container only."""
OWN_VOLUMES = ("settings", "run", "loader-tmp", CACHE_VOLUME, SHM_VOLUME, CREDENTIALS_VOLUME,
               FILL_SECRET_VOLUME)
"""Volume names the operator uses; a user's `volumes` entry may not reuse one."""

def loader_security_context(spec: DeploymentSpec) -> dict[str, Any]:
    """Pod Security `restricted`: the loader only reads the network and writes its namespace's
    `cache/`, as the platform's non-root user (chart `nodeCache.uid`/`gid`), who owns that
    directory: the node agent prepared it so before the kubelet could mount it (see [Note: node
    directory ownership] in `node_directories`; fsGroup would not apply to a hostPath volume)."""
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "privileged": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "runAsUser": spec.loader.run_as_user,
        "runAsGroup": spec.loader.run_as_group,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def build_pod_template(owner: Owner, spec: DeploymentSpec, revision: str,
                       annotations: dict[str, str]) -> dict[str, Any]:
    group_env: list[dict[str, Any]] = [
        {"name": POD_NAME_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": REVISION_ENV, "value": revision},
        {"name": FILL_GROUP_ENV, "valueFrom": {"configMapKeyRef": {
            "name": owner.fill_group_name, "key": FILL_GROUP_KEY, "optional": True}}},
    ]
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": spec.automount_service_account_token,
        "enableServiceLinks": False,
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
        "affinity": _affinity(owner, spec),
        "initContainers": [loader_container(spec, group_env, sidecar=True)],
        "containers": [_inference_container(owner.name, spec)],
        "volumes": volumes(owner, owner.settings_name(revision), spec),
    }
    if spec.service_account_name:
        pod_spec["serviceAccountName"] = spec.service_account_name
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in spec.tolerations]
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [copy.deepcopy(dict(s)) for s in spec.image_pull_secrets]
    for key, value in (("priorityClassName", spec.priority_class_name),
                       ("runtimeClassName", spec.runtime_class_name)):
        if value:
            pod_spec[key] = value
    return {
        "metadata": {"labels": {**spec.pod_labels, **selector_labels(owner)},
                     "annotations": {**spec.pod_annotations, **annotations}},
        "spec": pod_spec,
    }


def volumes(owner: Owner, settings_configmap: str,
            spec: DeploymentSpec) -> list[dict[str, Any]]:
    """Settings (the revision's ConfigMap), the run and tmp dirs, the node cache (the pod's
    claim of its namespace's directory on its node), the DOD's fill Secret, the source's key
    file (`source_access`) and the DOD's own volumes (a `file:///` share among them)."""
    volumes: list[dict[str, Any]] = [
        {"name": "settings", "configMap": {
            "name": settings_configmap, "items": [{"key": SETTINGS_KEY, "path": SETTINGS_KEY}],
        }},
        {"name": "run", "emptyDir": {}},
        {"name": "loader-tmp", "emptyDir": {}},
        build_cache_volume(),
    ]
    shm: dict[str, Any] = {"medium": "Memory"}
    if spec.shm_size:
        shm["sizeLimit"] = spec.shm_size
    volumes.append({"name": SHM_VOLUME, "emptyDir": shm})
    # Read by the loader's user (no fsGroup: the file is root's); only the loader mounts it.
    volumes.append({"name": FILL_SECRET_VOLUME, "secret": {
        "secretName": owner.fill_secret_name, "defaultMode": 0o444,
        "items": [{"key": FILL_SECRET_KEY, "path": FILL_SECRET_KEY}]}})
    return volumes + source_volumes(spec) + [copy.deepcopy(dict(v)) for v in spec.volumes]


def loader_container(spec: DeploymentSpec, group_env: list[dict[str, Any]], *,
                     sidecar: bool = False) -> dict[str, Any]:
    """Contract C2: `dlo cache fill`; `group_env` says where it learns its fill group; the
    DOD's fill Secret is its alone (`DLO_FILL_SECRET_FILE`); its source's credentials and mounts
    come from `source_access`. As the
    workload pod's `sidecar` it stays up after publishing and is ready once the entry document
    exists; in the prefill Job it is an ordinary container that ends with its fill."""
    env: list[dict[str, Any]] = [*group_env, {"name": CONFIG_ENV, "value": DEFAULT_CONFIG_PATH},
                                 {"name": FILL_SECRET_ENV, "value": DEFAULT_FILL_SECRET_FILE}]
    # The node, for the other loaders of a fill group to name this one if it is lost.
    env.append({"name": NODE_NAME_ENV, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}})
    env += credential_env(spec)
    args = ["--config", DEFAULT_CONFIG_PATH, "--entry-file", DEFAULT_ENTRY_FILE]
    container: dict[str, Any] = {
        "name": LOADER_CONTAINER,
        "image": spec.loader.image,
        "imagePullPolicy": spec.loader.image_pull_policy,
        "command": ["dlo", "cache", "fill"],
        "args": args,
        "env": env,
        "ports": _loader_ports(spec),
        "resources": copy.deepcopy(dict(spec.loader.resources)),
        "securityContext": loader_security_context(spec),
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [
            {"name": "settings", "mountPath": SETTINGS_MOUNT, "readOnly": True},
            {"name": "run", "mountPath": RUN_DIR},
            {"name": "loader-tmp", "mountPath": LOADER_TMP},
            {"name": CACHE_VOLUME, "mountPath": spec.settings.cache.root,
             "subPath": CACHE_SUBPATH},
            {"name": FILL_SECRET_VOLUME, "mountPath": FILL_SECRET_MOUNT, "readOnly": True},
            *source_mounts(spec),
        ],
    }
    if sidecar:
        args += ["--keep-running", "--yield-cpu"]
        container["restartPolicy"] = "Always"
        container["readinessProbe"] = {
            "exec": {"command": ["test", "-s", DEFAULT_ENTRY_FILE]},
            "periodSeconds": 2, "failureThreshold": 1,
        }
    return container


def _loader_ports(spec: DeploymentSpec) -> list[dict[str, Any]]:
    """The rendezvous, and `/metrics` (the operator's live progress, a PodMonitor) unless off."""
    ports = [{"name": "rendezvous", "containerPort": spec.loader.port, "protocol": "TCP"}]
    if spec.settings.loader.metrics_port:
        ports.append({"name": LOADER_METRICS_PORT_NAME,
                      "containerPort": spec.settings.loader.metrics_port, "protocol": "TCP"})
    return ports


def _inference_container(dod: str, spec: DeploymentSpec) -> dict[str, Any]:
    """Contract C3: settings and entry file in `DLO_*` (the entry file names the cache root).
    The entries are read-only, always: a server never writes what another pod maps. The runtime
    cache publishes into its own DOD's directory (`runtime/<dod>` of the claim), writable."""
    inference = spec.inference
    settings = spec.settings
    mounts: list[dict[str, Any]] = [
        {"name": "settings", "mountPath": SETTINGS_MOUNT, "readOnly": True},
        {"name": "run", "mountPath": RUN_DIR, "readOnly": True},
        {"name": CACHE_VOLUME, "mountPath": settings.cache.root, "subPath": CACHE_SUBPATH,
         "readOnly": True},
    ]
    if runtime_cache_on(settings):
        mounts.append({"name": CACHE_VOLUME, "mountPath": settings.runtime_cache_root,
                       "subPath": runtime_subpath(dod)})
    mounts.append({"name": SHM_VOLUME, "mountPath": SHM_PATH})
    mounts += [copy.deepcopy(dict(m)) for m in inference.volume_mounts]
    env = [copy.deepcopy(dict(e)) for e in inference.env] + [
        {"name": CONFIG_ENV, "value": DEFAULT_CONFIG_PATH},
        {"name": ENTRY_FILE_ENV, "value": DEFAULT_ENTRY_FILE},
        {"name": ENTRY_WAIT_ENV, "value": f"{settings.loader.timeout_s:g}"},
    ]
    container: dict[str, Any] = {
        "name": INFERENCE_CONTAINER,
        "image": inference.image,
        "imagePullPolicy": inference.image_pull_policy,
        "env": env,
        "resources": _inference_resources(spec),
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": mounts,
    }
    if inference.command:
        container["command"] = list(inference.command)
    if inference.args:
        container["args"] = list(inference.args)
    if inference.ports:
        container["ports"] = [copy.deepcopy(dict(p)) for p in inference.ports]
    for key, probe in (("readinessProbe", inference.readiness_probe),
                       ("startupProbe", inference.startup_probe),
                       ("livenessProbe", inference.liveness_probe)):
        if probe:
            container[key] = copy.deepcopy(dict(probe))
    return container


def _inference_resources(spec: DeploymentSpec) -> dict[str, Any]:
    resources = copy.deepcopy(dict(spec.inference.resources))
    if spec.gpus_per_pod:
        resources.setdefault("limits", {})[GPU_RESOURCE] = str(spec.gpus_per_pod)
    return resources


def _affinity(owner: Owner, spec: DeploymentSpec) -> dict[str, Any]:
    """The user's affinity plus a required anti-affinity term: one pod of this DOD per node."""
    affinity = copy.deepcopy(dict(spec.affinity))
    anti = affinity.setdefault("podAntiAffinity", {})
    terms = anti.setdefault("requiredDuringSchedulingIgnoredDuringExecution", [])
    terms.append({
        "labelSelector": {"matchLabels": selector_labels(owner)},
        "topologyKey": "kubernetes.io/hostname",
    })
    return affinity
