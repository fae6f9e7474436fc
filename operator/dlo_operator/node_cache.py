"""The node cache as a volume: the pods' claim template, and the PersistentVolume that serves it.

[Note: the node cache's tenant boundary] A pod never names a node directory. Each workload and
prefill pod carries one generic ephemeral volume (`build_cache_volume`) of the StorageClass
`NODE_CACHE_CLASS`, whose provisioner is this operator (`PROVISIONER`): the ephemeral-volume
controller creates one claim per pod in the pod's namespace, and the scheduler, once it picked
the pod's node (`volumeBindingMode: WaitForFirstConsumer`), annotates the claim with that node
(`SELECTED_NODE`). `build_persistent_volume` then serves that claim, and that claim only
(`claimRef` with its uid), from `<platform root>/namespaces/<claim's namespace>` on that node
(required node affinity). The directory comes from the claim's namespace and the platform's root
(the chart's `nodeCache.hostPath`) alone: nothing a tenant writes (a DOD, a claim's name or
annotations) reaches it, so a pod sees only its own namespace's entries, which its own loader
listed with its own credentials. Inside the pod (`pod`), the loader mounts the namespace's
`CACHE_SUBPATH` writable, the inference container mounts it read-only, and the runtime cache
gets `runtime_subpath(dod)`, beside the entries and never overlapping them. The bytes are not
shared across namespaces: two namespaces that serve one model each cache it.

The volume's hostPath has type `Directory`: the kubelet mounts it only once the node agent of the
claim's node (`node_agent`, named by `NODE_ANNOTATION`) made it, with `cache/` owned by the loader's
non-root user (see [Note: node directory ownership] in `node_directories`); until then the mount
fails and the kubelet retries it. The pod's volume is `ephemeral`, a type Pod Security `restricted`
allows: no tenant namespace needs `privileged`. A claim is deleted with its pod, so a restarted pod
is never held to the node an older claim was bound to. Pure; called by `pod` (the template) and
`provisioner` (the PV).
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dlo_contract.names import DEFAULT_CACHE_ROOT

NODE_CACHE_CLASS = "dlo-node-cache"
"""The StorageClass the chart creates and every pod's claim names (fixed: the pods' template and
the provisioner must agree on it without a setting each)."""
PROVISIONER = "dlo.dev/node-cache"
"""The StorageClass's `provisioner`: this operator."""
SELECTED_NODE = "volume.kubernetes.io/selected-node"
"""Set on a claim by the scheduler (WaitForFirstConsumer): the node its pod will run on."""
PROVISIONED_BY = "pv.kubernetes.io/provisioned-by"
LABEL_NODE_CACHE = "dlo.dev/node-cache"
"""On every PersistentVolume this operator made: the watch on volumes filters on it."""
NODE_ANNOTATION = "dlo.dev/node"
"""On every PersistentVolume this operator made: the name of the node it serves (the node agent
of that node prepares its directory; a label value could not hold every node name)."""
HOSTNAME_LABEL = "kubernetes.io/hostname"
DEFAULT_NODE_CACHE_ROOT = posixpath.dirname(DEFAULT_CACHE_ROOT)
"""The platform's node directory that holds `namespaces/<namespace>` (`/var/lib/dlo`)."""
CACHE_VOLUME = "node-cache"
CACHE_SUBPATH = "cache"
"""The namespace's entries (the loader's `cache.root`)."""
RUNTIME_SUBPATH = "runtime"
"""Runtime-cache directories, one per DOD: `runtime/<dod>`."""
DEFAULT_RUNTIME_CACHE_PATH = f"{DEFAULT_NODE_CACHE_ROOT}/runtime"
"""Where the inference container sees its DOD's runtime cache when `offload.runtimeCacheRoot`
is empty (a path in the container, beside the default `cache.hostPath`, not inside it)."""
CLAIM_ACCESS_MODE = "ReadWriteOncePod"
"""The pods' claims and their volumes: one pod alone mounts a claim (GA in Kubernetes 1.29)."""
CLAIM_STORAGE = "1Gi"
"""The claim's nominal size: a hostPath volume has no capacity limit, and the node's cache keeps
its own (`cache.maxBytes`, `cache.minFreeBytes`)."""


@dataclass(frozen=True)
class NodeCacheConfig:
    """What the platform decides about the node cache (chart `nodeCache`, operator flags)."""

    root: str = DEFAULT_NODE_CACHE_ROOT
    """Node directory under which each namespace's cache lives (`<root>/namespaces/<ns>`)."""


@dataclass(frozen=True)
class Claim:
    """A claim of the node-cache class whose pod's node is chosen and which has no volume yet."""

    namespace: str
    name: str
    uid: str
    node: str
    storage: str
    access_modes: tuple[str, ...]


def build_cache_volume() -> dict[str, Any]:
    """The pod's node-cache volume: one claim per pod, deleted with the pod, that no other pod
    can mount (`ReadWriteOncePod`: a pod that names the claim stays Pending)."""
    return {"name": CACHE_VOLUME, "ephemeral": {"volumeClaimTemplate": {"spec": {
        "accessModes": [CLAIM_ACCESS_MODE],
        "storageClassName": NODE_CACHE_CLASS,
        "resources": {"requests": {"storage": CLAIM_STORAGE}},
    }}}}


def is_pod_cache_claim_name(name: str) -> bool:
    """Whether a claim of this name may be a pod's node-cache claim: the ephemeral-volume
    controller names it `<pod>-<CACHE_VOLUME>`."""
    return name.endswith(f"-{CACHE_VOLUME}")


def runtime_subpath(dod: str) -> str:
    return f"{RUNTIME_SUBPATH}/{dod}"


def namespace_directory(config: NodeCacheConfig, namespace: str) -> str:
    """The node directory of one namespace (a namespace name is a DNS label: no '/' or '..')."""
    return f"{config.root.rstrip('/')}/namespaces/{namespace}"


def volume_name(claim_uid: str) -> str:
    return f"dlo-node-cache-{claim_uid}"


def pending_claim(pvc: Mapping[str, Any]) -> Claim | None:
    """The claim to serve, or None: another class, no node chosen yet, bound already, being
    deleted, asking for a raw block device (the cache is a directory), or not a pod's own."""
    meta, spec = pvc.get("metadata") or {}, pvc.get("spec") or {}
    node = (meta.get("annotations") or {}).get(SELECTED_NODE)
    if (spec.get("storageClassName") != NODE_CACHE_CLASS or not node or spec.get("volumeName")
            or meta.get("deletionTimestamp") or spec.get("volumeMode") == "Block"
            or not pod_owned(meta)):
        return None
    storage = ((spec.get("resources") or {}).get("requests") or {}).get("storage")
    return Claim(namespace=meta["namespace"], name=meta["name"], uid=meta["uid"], node=node,
                 storage=str(storage or CLAIM_STORAGE),
                 access_modes=tuple(spec.get("accessModes") or (CLAIM_ACCESS_MODE,)))


def pod_owned(meta: Mapping[str, Any]) -> bool:
    """Whether a claim is a pod's ephemeral claim: the ephemeral-volume controller names it
    `<pod>-<volume>` and makes that pod its controller, so it goes with the pod. A claim a
    tenant made on its own would outlive its pods and be mounted by any of them."""
    name = str(meta.get("name") or "")
    return any(ref.get("kind") == "Pod" and ref.get("apiVersion") == "v1"
               and ref.get("controller") is True and name.startswith(f"{ref.get('name')}-")
               for ref in meta.get("ownerReferences") or ())


def not_a_pods_claim(pvc: Mapping[str, Any]) -> bool:
    """A claim of the node cache's class that no pod controls (`pod_owned`): never served."""
    meta, spec = pvc.get("metadata") or {}, pvc.get("spec") or {}
    return spec.get("storageClassName") == NODE_CACHE_CLASS and not pod_owned(meta)


def build_persistent_volume(claim: Claim, hostname: str,
                            config: NodeCacheConfig) -> dict[str, Any]:
    """The volume of `claim`: its namespace's directory on its node (`hostname`, the node's
    `kubernetes.io/hostname` label), pre-bound to it alone; deleted once the claim is gone."""
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": volume_name(claim.uid), "labels": {LABEL_NODE_CACHE: "true"},
                     "annotations": {PROVISIONED_BY: PROVISIONER, NODE_ANNOTATION: claim.node}},
        "spec": {
            "capacity": {"storage": claim.storage},
            "accessModes": list(claim.access_modes),
            "volumeMode": "Filesystem",
            "persistentVolumeReclaimPolicy": "Delete",
            "storageClassName": NODE_CACHE_CLASS,
            "claimRef": {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                         "namespace": claim.namespace, "name": claim.name, "uid": claim.uid},
            "hostPath": {"path": namespace_directory(config, claim.namespace),
                         "type": "Directory"},
            "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                {"key": HOSTNAME_LABEL, "operator": "In", "values": [hostname]}]}]}},
        },
    }


def claim_reference(pv: Mapping[str, Any]) -> tuple[str, str, str]:
    """(namespace, name, uid) of the claim a volume serves."""
    ref = (pv.get("spec") or {}).get("claimRef") or {}
    return ref.get("namespace", ""), ref.get("name", ""), ref.get("uid", "")


def claim_gone(pv: Mapping[str, Any], live_claim: Mapping[str, Any] | None) -> bool:
    """Whether a volume's claim no longer exists: released, absent, or a new claim of the same
    name (another uid) that this volume must never serve."""
    if ((pv.get("status") or {}).get("phase")) == "Released":
        return True
    uid = claim_reference(pv)[2]
    return live_claim is None or (live_claim.get("metadata") or {}).get("uid") != uid
