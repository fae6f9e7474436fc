"""`build_statefulset`: N workload pods, one per node, all started at once.

`podManagementPolicy: Parallel` because the N loaders must all be running to rendezvous (ordered
start would deadlock pod 0 waiting for pod 1). The pod template carries the settings hash, so a
spec change that alters the settings document rolls the pods. Pure; called by `manifests`.
"""

from __future__ import annotations

from typing import Any

from dlo_operator.configmap import settings_hash
from dlo_operator.naming import ANNOTATION_SETTINGS_HASH, Owner, child_metadata, selector_labels
from dlo_operator.pod import build_pod_template
from dlo_operator.spec import DeploymentSpec


def build_statefulset(owner: Owner, spec: DeploymentSpec) -> dict[str, Any]:
    template = build_pod_template(owner, spec, {ANNOTATION_SETTINGS_HASH: settings_hash(owner, spec)})
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": child_metadata(owner, owner.statefulset_name),
        "spec": {
            "replicas": spec.replicas,
            "serviceName": owner.service_name,
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "RollingUpdate"},
            "selector": {"matchLabels": selector_labels(owner)},
            "template": template,
        },
    }
