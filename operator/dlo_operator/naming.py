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
name, 63), pod `<name>-<index>` (a DNS label, 63), `<name>-settings` (a ConfigMap, 253),
`<name>-fill-secret` (a Secret, 253). The CRD's
`[name-dns-1035]` rule checks the same bound at `kubectl apply`."""

LABEL_DEPLOYMENT = f"{GROUP}/deployment"
"""On every child and every workload pod: the name of the owning DOD (the pod watcher's key)."""
LABEL_POD_INDEX = "apps.kubernetes.io/pod-index"
"""Set by the StatefulSet controller (Kubernetes 1.28+); the loader's rank."""
ANNOTATION_SETTINGS_HASH = f"{GROUP}/settings-sha256"
"""On the pod template: changes with the settings document, so an update rolls the pods."""
ANNOTATION_REVISION = f"{GROUP}/revision"
"""On the pod template and the children of one revision: the settings revision they serve."""
ANNOTATION_ENTRY_KEY = f"{GROUP}/entry-key"
"""On the pod template: what decides the cache entry; a change of it needs a prefill first."""
ANNOTATION_FILL_SUMMARY = f"{GROUP}/fill-summary"
"""On a workload pod: its sidecar loader's one-line fill summary, which the operator copies from
the loader's endpoint once it published (a sidecar stays up: no termination message)."""
ANNOTATION_LOADER_IMAGE_UPDATE = f"{GROUP}/loader-image-update"
"""On a DOD: overrides the chart's `loaderImageUpdate` for it (`loader_image`)."""
LABEL_ROLE = f"{GROUP}/role"
"""On children other than the workload: `settings`, `fill-group` or `prefill`."""
LABEL_REVISION = f"{GROUP}/revision"
"""On per-revision children (settings ConfigMap, prefill Job and its pods)."""
LABEL_JOB_INDEX = "batch.kubernetes.io/job-completion-index"
"""Set by the Job controller on the pods of an Indexed Job: the prefill loader's rank."""
LABEL_APP_NAME = "app.kubernetes.io/name"
"""`WORKLOAD_APP` on the workload pods (a selector label, which `spec.podLabels` may not set)."""
WORKLOAD_APP = "dlo-workload"
PREFILL_ROLE = "prefill"
"""`LABEL_ROLE` of the prefill Jobs, their pods and their Service."""

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

    def settings_name(self, revision: str) -> str:
        """The immutable settings ConfigMap of one revision."""
        return f"{self.name}-settings-{revision}"

    @property
    def fill_group_name(self) -> str:
        """The ConfigMap holding the fill-group document the workload pods' loaders read."""
        return f"{self.name}-fill-group"

    @property
    def prefill_service_name(self) -> str:
        """Headless Service of the prefill Jobs' pods (rank 0 hosts their rendezvous)."""
        return f"{self.name}-prefill"

    def prefill_name(self, revision: str) -> str:
        return f"{self.name}-prefill-{revision}"

    def prefill_master_addr(self, revision: str) -> str:
        return self.pod_address(f"{self.prefill_name(revision)}-0", self.prefill_service_name)

    @property
    def service_name(self) -> str:
        """Headless Service giving every pod a stable DNS name (pod 0 hosts the rendezvous)."""
        return f"{self.name}-peers"

    @property
    def statefulset_name(self) -> str:
        return self.name

    def pod_name(self, ordinal: int) -> str:
        """The StatefulSet's pod of `ordinal`."""
        return f"{self.statefulset_name}-{ordinal}"

    @property
    def inference_service_name(self) -> str:
        """ClusterIP Service of the inference ports (clients address `<name>.<namespace>`)."""
        return self.name

    @property
    def disruption_budget_name(self) -> str:
        return self.name

    @property
    def network_policy_name(self) -> str:
        """The NetworkPolicy of the DOD's pods (`network_policy`)."""
        return self.name

    @property
    def fill_secret_name(self) -> str:
        return fill_secret_name(self.name)

    def master_addr(self) -> str:
        """Pod 0's DNS name (the rendezvous of a create's fill group)."""
        return self.pod_address(self.pod_name(0), self.service_name)

    def pod_address(self, pod: str, service: str) -> str:
        """A pod's DNS name under a headless Service, relative to the pod's search domains
        (`<ns>.svc.<cluster-domain>`), so it resolves whatever the cluster domain is."""
        return f"{pod}.{service}.{self.namespace}.svc"


def fill_secret_name(dod_name: str) -> str:
    """The DOD's fill Secret (`fill_secret`): random bytes its loaders key their group with.
    At most 52 + 12 characters, well within a Secret's 253."""
    return f"{dod_name}-fill-secret"


def selector_labels(owner: Owner) -> dict[str, str]:
    """The immutable StatefulSet selector; also what the anti-affinity term matches."""
    return {
        LABEL_APP_NAME: WORKLOAD_APP,
        "app.kubernetes.io/instance": owner.name,
        LABEL_DEPLOYMENT: owner.name,
    }


def child_labels(owner: Owner) -> dict[str, str]:
    return {**selector_labels(owner), "app.kubernetes.io/managed-by": FIELD_MANAGER}


def child_metadata(owner: Owner, name: str, **labels: str) -> dict[str, Any]:
    """metadata for a child: name, namespace, labels (plus `labels`) and (with a known uid) the
    owner reference that lets the garbage collector delete the child with its DOD."""
    meta: dict[str, Any] = {
        "name": name, "namespace": owner.namespace, "labels": {**child_labels(owner), **labels},
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


def labels_of(obj: Mapping[str, Any]) -> Mapping[str, str]:
    """An object's labels ({} when it has none)."""
    return (obj.get("metadata") or {}).get("labels") or {}


UNCONTROLLED = "no controller"
"""`foreign_controller`'s answer for an object that nothing controls."""


def foreign_controller(owner: Owner, child: Mapping[str, Any] | None) -> str | None:
    """Who controls `child` if not `owner` ("DiffusionOffloadDeployment flux", or
    `UNCONTROLLED`), else None (`child` is `owner`'s, or absent).

    Child names are `<dod>`, `<dod>-peers`, `<dod>-prefill`, ...: DOD `flux`'s headless Service
    `flux-peers` is DOD `flux-peers`'s inference Service. The controller reference (or, on an
    object without one, the deployment label) says whose it is; a DOD of `owner`'s name with
    another uid is the one `owner` replaced (its children wait for the garbage collector) and
    counts as `owner`, and so does an object without a controller that carries `owner`'s
    deployment label (`dlo render`'s output, applied by hand). Any other object is never
    `owner`'s: writing it would give a DOD author every object of the namespace named like one
    of its children (a Service, a Secret), taken over and deleted with the DOD."""
    if child is None:
        return None
    meta = child.get("metadata") or {}
    ref = next((r for r in meta.get("ownerReferences") or () if r.get("controller")), None)
    if ref is not None:
        mine = (ref.get("kind") == KIND and str(ref.get("apiVersion", "")).startswith(f"{GROUP}/")
                and ref.get("name") == owner.name)
        return None if mine else f"{ref.get('kind')} {ref.get('name')}"
    labelled = labels_of(child).get(LABEL_DEPLOYMENT)
    if labelled == owner.name:
        return None
    return f"{KIND} {labelled}" if labelled else UNCONTROLLED


def owns(owner: Owner, child: Mapping[str, Any] | None) -> bool:
    """Whether `child` (None: absent) carries `owner`'s owner reference: an object of the same
    name that someone else made is never the operator's to delete."""
    refs = ((child or {}).get("metadata") or {}).get("ownerReferences") or ()
    return owner.uid is not None and any(ref.get("uid") == owner.uid for ref in refs)
