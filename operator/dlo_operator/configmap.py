"""`build_configmap`: the normalized settings document every container of the pod mounts.

The document is `Settings.to_json()` of the validated settings, so the loader and the runtime read
exactly what the operator accepted (contract C3: key `names.SETTINGS_FILE`, mounted at
`names.DEFAULT_CONFIG_PATH`). Its `origin` names the DOD, so that a reader's error names the CR's
fields as the user wrote them. Pure; called by `manifests`.
"""

from __future__ import annotations

import hashlib
from typing import Any

from dlo_operator.naming import KIND, SETTINGS_KEY, Owner, child_metadata
from dlo_operator.spec import DeploymentSpec


def settings_document(owner: Owner, spec: DeploymentSpec) -> str:
    origin = f"{KIND} {owner.namespace}/{owner.name}"
    return spec.settings.model_copy(update={"origin": origin}).to_json()


def settings_hash(owner: Owner, spec: DeploymentSpec) -> str:
    """SHA-256 of the document; the pod template carries it so a settings change rolls pods."""
    return hashlib.sha256(settings_document(owner, spec).encode()).hexdigest()


def build_configmap(owner: Owner, spec: DeploymentSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": child_metadata(owner, owner.configmap_name),
        "data": {SETTINGS_KEY: settings_document(owner, spec)},
    }
