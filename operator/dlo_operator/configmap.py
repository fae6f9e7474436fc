"""Settings ConfigMaps (one immutable ConfigMap per revision) and the fill-group ConfigMap.

The settings document is the canonical form of the validated settings
(`settings_history.canonical_json`: every field, except one added by a later release while it
holds the default it was added with, which readers fill in), so the loader and the runtime read
exactly what the operator accepted (contract C3: key `names.SETTINGS_FILE`, mounted at
`names.DEFAULT_CONFIG_PATH`); its `origin` names the DOD, so that a reader's error names the CR's
fields as the user wrote them. Its revision is a digest of that canonical document: a release
that only adds fields keeps every DOD's revision (and its pods), and one revision always names
one content. A pod mounts the ConfigMap of its revision, which never changes, so a pod never
reads settings that do not match its entry, and a rollback finds the settings of the revision it
goes back to. `entry_key` digests only what
decides the cache entry (source, include globs, endpoint, cache root): when it changes, the new
entry is prefilled before any pod restarts. Pure; called by `manifests`, `prefill`, `rollout`
and `prefill_stage`.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from dlo_contract.fill_group import FILL_GROUP_KEY, FillGroup
from dlo_contract.settings_history import canonical, canonical_json
from dlo_operator.naming import (
    KIND,
    LABEL_REVISION,
    LABEL_ROLE,
    SETTINGS_KEY,
    Owner,
    child_metadata,
)
from dlo_operator.spec import DeploymentSpec

REVISION_CHARS = 10
"""Hex digits of the settings digest in a revision name (collisions need 2^40 revisions)."""


def settings_document(owner: Owner, spec: DeploymentSpec) -> str:
    origin = f"{KIND} {owner.namespace}/{owner.name}"
    return canonical_json(spec.settings.model_copy(update={"origin": origin}))


def settings_hash(spec: DeploymentSpec) -> str:
    """SHA-256 of the canonical settings (without their origin, which is the same for every
    revision)."""
    return hashlib.sha256(canonical_json(spec.settings).encode()).hexdigest()


def revision(spec: DeploymentSpec) -> str:
    """The revision name of the settings document (part of child names and labels)."""
    return settings_hash(spec)[:REVISION_CHARS]


ENTRY_FIELDS = {"source": "loader.source", "include": "loader.include",
                "endpoint_url": "loader.endpoint_url", "region": "loader.region",
                "path_style": "loader.path_style", "cache_root": "cache.root"}
"""Key in the entry digest -> the settings field that decides which bytes the entry holds. A
field added here by a later release counts only where the document carries it (not at the
default it was added with), so that adding it keeps every entry key."""


def entry_key(spec: DeploymentSpec) -> str:
    """A digest of the settings that decide which cache entry the loader fills. Equal keys may
    still name different entries (the store's objects changed); the loader's own identity check
    covers that, with a fill in the restarted pod."""
    document = canonical(spec.settings)
    fields = {}
    for key, path in ENTRY_FIELDS.items():
        section, name = path.split(".")
        if name in document.get(section, {}):
            fields[key] = document[section][name]
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def build_configmap(owner: Owner, spec: DeploymentSpec) -> dict[str, Any]:
    """The immutable settings ConfigMap of `spec`'s revision."""
    rev = revision(spec)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": child_metadata(owner, owner.settings_name(rev),
                                   **{LABEL_ROLE: "settings", LABEL_REVISION: rev}),
        "immutable": True,
        "data": {SETTINGS_KEY: settings_document(owner, spec)},
    }


def build_fill_group_configmap(owner: Owner, group: FillGroup) -> dict[str, Any]:
    """The fill-group document workload pods' loaders receive as `DLO_FILL_GROUP`."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": child_metadata(owner, owner.fill_group_name, **{LABEL_ROLE: "fill-group"}),
        "data": {FILL_GROUP_KEY: group.to_json()},
    }
