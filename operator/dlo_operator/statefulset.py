"""`build_statefulset`: the workload pods, one per node, all started at once.

`podManagementPolicy: Parallel` because the loaders of a fill group must all be running to
rendezvous (ordered start would deadlock the first member waiting for the next). The pod template
names the revision's immutable settings ConfigMap and carries the revision and entry key, so a
spec change that alters the settings document rolls the pods; `replicas` appears only in the
StatefulSet's spec, never in the template, so scaling restarts no pod. Pure; called by
`manifests`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dlo_operator.configmap import entry_key, revision, settings_hash
from dlo_operator.naming import (
    ANNOTATION_ENTRY_KEY,
    ANNOTATION_REVISION,
    ANNOTATION_SETTINGS_HASH,
    Owner,
    child_metadata,
    selector_labels,
)
from dlo_operator.pod import build_pod_template
from dlo_operator.spec import DeploymentSpec


def build_statefulset(owner: Owner, spec: DeploymentSpec,
                      replicas: int | None = None) -> dict[str, Any]:
    """`replicas` overrides `spec.replicas` (the operator steps a scale-up through its groups)."""
    rev = revision(spec)
    template = build_pod_template(owner, spec, rev, {
        ANNOTATION_SETTINGS_HASH: settings_hash(spec), ANNOTATION_REVISION: rev,
        ANNOTATION_ENTRY_KEY: entry_key(spec)})
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": child_metadata(owner, owner.statefulset_name),
        "spec": {
            "replicas": spec.replicas if replicas is None else replicas,
            "serviceName": owner.service_name,
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "RollingUpdate"},
            "selector": {"matchLabels": selector_labels(owner)},
            "template": template,
        },
    }


def template_revision(statefulset: dict[str, Any] | None) -> tuple[str, str] | None:
    """(revision, entry key) a live StatefulSet's template serves, or None without one."""
    if not statefulset:
        return None
    annotations = (((statefulset.get("spec") or {}).get("template") or {}).get("metadata")
                   or {}).get("annotations") or {}
    return annotations.get(ANNOTATION_REVISION, ""), annotations.get(ANNOTATION_ENTRY_KEY, "")


def live_replicas(statefulset: Mapping[str, Any] | None) -> int:
    """The replicas the live StatefulSet asks for (0 when there is none)."""
    return int(((statefulset or {}).get("spec") or {}).get("replicas") or 0)
