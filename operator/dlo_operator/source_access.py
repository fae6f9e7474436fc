"""How the loader reaches the DOD's source: its credentials and, for `file:///`, the share.

Owns the part of contract C2 that depends on `model.source`'s scheme. A Secret reference
(`model.credentials.secretName`) becomes the variables that scheme's reader reads
(`dlo_contract.source_credentials`), each a `secretKeyRef` (never a value: the rendered
manifests, the status and the operator's logs hold names only), and for `gs://` a read-only
Secret volume holding the service-account key file; without a Secret nothing is added and each
client uses the pod's workload identity. A `file:///` source's share (`model.share`) is one of the
DOD's own `spec.volumes`, which `host_paths` already holds to the platform's allowlist, mounted
read-only into the loader alone.

What a DOD author could reach that is not theirs: a Secret or a persistentVolumeClaim is looked
up in the pod's namespace, the DOD's own, by the kubelet, so another namespace's is out of reach
by construction; a hostPath share must lie under the chart's `allowedUserHostPaths`; an `nfs`
volume reaches what the node may mount, as the DOD's own `spec.volumes` could already. Pure;
called by `pod` (the container and volumes) and `pod_rules` (`share_problems`).
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Any

from dlo_contract.deployment import CredentialsConfig
from dlo_contract.source_credentials import (
    AWS_SESSION_TOKEN_ENV,
    AZURE_ACCOUNT_KEY_ENV,
    AZURE_CONNECTION_STRING_ENV,
    AZURE_SAS_TOKEN_ENV,
    GCS_KEY_FILE,
    GOOGLE_APPLICATION_CREDENTIALS_ENV,
    SCHEME_CREDENTIALS,
    SOURCE_CREDENTIALS_MOUNT,
    Scheme,
)
from dlo_contract.source_uri import SourceAddress, parse_source_uri
from dlo_contract.validation import cr_names
from dlo_operator.host_paths import OWN_MOUNT_PATHS, overlaps, within
from dlo_operator.spec import DeploymentSpec, field_name

CREDENTIALS_VOLUME = "source-credentials"
"""The Secret volume of a `gs://` key file (one of the operator's own volume names)."""


@dataclass(frozen=True)
class SecretVar:
    """One credential variable: its name, the `model.credentials` field naming its key in the
    Secret, and whether the Secret may lack that key."""

    env: str
    key_field: str
    optional: bool = False

    def key(self, creds: CredentialsConfig) -> str:
        return str(getattr(creds, self.key_field))


_OPTIONAL_VARS = frozenset({AWS_SESSION_TOKEN_ENV, AZURE_CONNECTION_STRING_ENV,
                            AZURE_ACCOUNT_KEY_ENV, AZURE_SAS_TOKEN_ENV})
"""The variables a reader uses only if present (their fields say "used only if present")."""
_KEY_FIELDS = {info.default: name for name, info in CredentialsConfig.model_fields.items()}
"""Each variable's `model.credentials` field: the field whose default key is the variable's name
(`dlo_contract.deployment` pairs them once)."""


def _secret_vars(scheme: Scheme) -> tuple[SecretVar, ...]:
    return tuple(SecretVar(env, _KEY_FIELDS[env], env in _OPTIONAL_VARS)
                 for env in SCHEME_CREDENTIALS[scheme].env if env in _KEY_FIELDS)


SECRET_VARS: dict[Scheme, tuple[SecretVar, ...]] = {
    scheme: variables for scheme in Scheme if (variables := _secret_vars(scheme))}
"""Each scheme's variables read from the Secret (`gs://` reads a file, `file:///` nothing)."""


def source_address(spec: DeploymentSpec) -> SourceAddress:
    return parse_source_uri(spec.settings.loader.source, cr_names)


def credential_env(spec: DeploymentSpec) -> list[dict[str, Any]]:
    """The loader's credential variables for its source's scheme: `secretKeyRef`s, and for
    `gs://` the key file's path; none without a Secret (workload identity)."""
    creds = spec.credentials
    if not creds.secret_name:
        return []
    scheme = source_address(spec).scheme
    if scheme is Scheme.GS:
        return [{"name": GOOGLE_APPLICATION_CREDENTIALS_ENV, "value": GCS_KEY_FILE}]
    return [{"name": var.env, "valueFrom": {"secretKeyRef": {
                "name": creds.secret_name, "key": var.key(creds), "optional": var.optional}}}
            for var in SECRET_VARS.get(scheme, ()) if var.key(creds)]


def source_volumes(spec: DeploymentSpec) -> list[dict[str, Any]]:
    """The `gs://` key file's Secret volume (the share is one of `spec.volumes`)."""
    creds = spec.credentials
    if not creds.secret_name or source_address(spec).scheme is not Scheme.GS:
        return []
    item = posixpath.relpath(GCS_KEY_FILE, SOURCE_CREDENTIALS_MOUNT)
    return [{"name": CREDENTIALS_VOLUME, "secret": {
        "secretName": creds.secret_name, "items": [{"key": creds.key_file_key, "path": item}]}}]


def source_mounts(spec: DeploymentSpec) -> list[dict[str, Any]]:
    """The loader's read-only mounts of its source: the key file's directory, the share."""
    mounts = [{"name": volume["name"], "mountPath": SOURCE_CREDENTIALS_MOUNT, "readOnly": True}
              for volume in source_volumes(spec)]
    if source_address(spec).scheme is Scheme.FILE:
        mounts.append({"name": spec.share.volume_name, "mountPath": spec.share.mount_path,
                       "readOnly": True})
    return mounts


_VOLUME, _MOUNT, _VOLUMES = (field_name("share.volume_name"), field_name("share.mount_path"),
                             field_name("volumes"))
SHARE_NEEDED_MESSAGE = (
    f"[source-share] a file:/// {cr_names('loader.source')} reads a share the loader mounts, "
    f"but {_VOLUME} names none; fix: set {_VOLUME} to the {_VOLUMES} entry holding the "
    "checkpoint, or use another scheme")
"""Said word for word by the CRD's CEL twin (`podCelRules` in `crd_base.yaml`)."""


def share_problems(spec: DeploymentSpec) -> list[str]:
    """A `file:///` source without its share, a share that is not one of `spec.volumes`, a path
    outside the share or a share hiding the loader's own mounts; a share for another scheme."""
    share, address = spec.share, source_address(spec)
    source = cr_names("loader.source")
    if address.scheme is not Scheme.FILE:
        if not share.volume_name:
            return []
        return [f"[source-share-scheme] {_VOLUME}={share.volume_name!r} is only read by a "
                f"file:/// source, and {source} is {address.scheme.value}://; fix: remove "
                f"{_VOLUME.rpartition('.')[0]}"]
    if not share.volume_name:
        return [SHARE_NEEDED_MESSAGE]
    problems = []
    if share.volume_name not in {str(v.get("name", "")) for v in spec.volumes}:
        problems.append(f"[source-share-volume] {_VOLUME}={share.volume_name!r} is not one of "
                        f"{_VOLUMES}; fix: add the share's volume (a persistentVolumeClaim or nfs "
                        f"volume) to {_VOLUMES} under that name")
    if not within(address.prefix.rstrip("/"), share.mount_path):
        problems.append(f"[source-share-path] {source}={str(address)!r} lies outside "
                        f"{_MOUNT}={share.mount_path!r}; fix: write the source as "
                        f"file://{share.mount_path}/<directory>/ or move the mount")
    own = [*OWN_MOUNT_PATHS, spec.settings.cache.root]
    clash = next((mount for mount in own if overlaps(share.mount_path, mount)), None)
    if clash is not None:
        problems.append(f"[source-share-path] {_MOUNT}={share.mount_path!r} overlaps the "
                        f"loader's mount path {clash!r}; fix: choose a directory that neither "
                        "contains nor lies inside it")
    return problems
