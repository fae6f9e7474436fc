"""Names, labels and annotations shared by the builders, the status reader and the handlers.

One place for every string the operator writes into the cluster, so that the selector the
StatefulSet uses, the label the pod watcher filters on and the names `dlo render` prints cannot
drift apart. Pure data and small pure functions; imports nothing from the cluster side.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dlo_contract.names import SETTINGS_FILE

GROUP = "dlo.dev"
VERSION = "v1alpha1"
KIND = "DiffusionOffloadDeployment"
PLURAL = "diffusionoffloaddeployments"
API_VERSION = f"{GROUP}/{VERSION}"
FIELD_MANAGER = "dlo-operator"

MAX_NAME_LENGTH = 52
"""Longest DOD name. The StatefulSet (named like the DOD) labels its pods
`controller-revision-hash: <name>-<hash of up to 10 characters>`, a label value of at most 63
characters: 63 - 1 - 10 = 52. Every other name fits below it: `<name>-peers` (a DNS-1035 Service
name, 63), pod `<name>-<index>` (a DNS label, 63), `<name>-settings` (a ConfigMap, 253). The CRD's
`[name-dns-1035]` rule checks the same bound at `kubectl apply`."""

LABEL_DEPLOYMENT = f"{GROUP}/deployment"
"""On every child and every workload pod: the name of the owning DOD (the pod watcher's key)."""
LABEL_POD_INDEX = "apps.kubernetes.io/pod-index"
"""Set by the StatefulSet controller (Kubernetes 1.28+); the loader's rank."""
ANNOTATION_SETTINGS_HASH = f"{GROUP}/settings-sha256"
"""On the pod template: changes with the settings document, so an update rolls the pods."""

SETTINGS_KEY = SETTINGS_FILE
"""The settings ConfigMap's key, mounted at `DEFAULT_CONFIG_PATH`."""
LOADER_TMP = "/tmp"
"""The loader's scratch space (an emptyDir: its root filesystem is read-only)."""
SHM_PATH = "/dev/shm"
LOADER_CONTAINER = "loader"
INFERENCE_CONTAINER = "inference"


@dataclass(frozen=True, kw_only=True)
class Owner:
    """The DOD a child belongs to. `uid` is None when rendering without a cluster."""

    name: str
    namespace: str
    uid: str | None = None

    @classmethod
    def from_body(cls, body: Mapping[str, Any], default_namespace: str = "default") -> Owner:
        meta = body.get("metadata") or {}
        return cls(
            name=meta.get("name", ""),
            namespace=meta.get("namespace") or default_namespace,
            uid=meta.get("uid"),
        )

    @property
    def configmap_name(self) -> str:
        return f"{self.name}-settings"

    @property
    def service_name(self) -> str:
        """Headless Service giving every pod a stable DNS name (pod 0 hosts the rendezvous)."""
        return f"{self.name}-peers"

    @property
    def statefulset_name(self) -> str:
        return self.name

    @property
    def inference_service_name(self) -> str:
        """ClusterIP Service of the inference ports (clients address `<name>.<namespace>`)."""
        return self.name

    @property
    def disruption_budget_name(self) -> str:
        return self.name

    def master_addr(self) -> str:
        """Pod 0's DNS name, relative to the pod's search domains (`<ns>.svc.<cluster-domain>`),
        so it resolves whatever the cluster domain is."""
        return f"{self.statefulset_name}-0.{self.service_name}.{self.namespace}.svc"


def selector_labels(owner: Owner) -> dict[str, str]:
    """The immutable StatefulSet selector; also what the anti-affinity term matches."""
    return {
        "app.kubernetes.io/name": "dlo-workload",
        "app.kubernetes.io/instance": owner.name,
        LABEL_DEPLOYMENT: owner.name,
    }


def child_labels(owner: Owner) -> dict[str, str]:
    return {**selector_labels(owner), "app.kubernetes.io/managed-by": FIELD_MANAGER}


def child_metadata(owner: Owner, name: str) -> dict[str, Any]:
    """metadata for a child: name, namespace, labels and (with a known uid) the owner reference
    that lets the garbage collector delete the child with its DOD."""
    meta: dict[str, Any] = {
        "name": name, "namespace": owner.namespace, "labels": child_labels(owner),
    }
    if owner.uid:
        meta["ownerReferences"] = [{
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": owner.name,
            "uid": owner.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }]
    return meta
