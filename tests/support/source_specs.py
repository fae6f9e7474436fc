"""One DOD spec per source scheme, each naming its credentials (a Secret, or for file:/// a
share), for the operator's render, CRD and strict-validation tests."""

from __future__ import annotations

from typing import Any

INFERENCE = {"image": "server:1"}
SECRET = "source-keys"
SCHEME_SPECS: dict[str, dict[str, Any]] = {
    "s3": {"model": {"source": "s3://models/flux/", "credentials": {"secretName": SECRET}},
           "inference": INFERENCE},
    "file-pvc": {"model": {"source": "file:///models/flux/", "share": {"volumeName": "weights"}},
                 "volumes": [{"name": "weights", "persistentVolumeClaim": {
                     "claimName": "model-share", "readOnly": True}}],
                 "inference": INFERENCE},
    "file-nfs": {"model": {"source": "file:///mnt/share/flux/", "share": {
                     "volumeName": "nfs", "mountPath": "/mnt/share"}},
                 "volumes": [{"name": "nfs", "nfs": {"server": "nfs.example.com",
                                                     "path": "/exports/models", "readOnly": True}}],
                 "inference": INFERENCE},
    "gs": {"model": {"source": "gs://models/flux/", "credentials": {
               "secretName": SECRET, "keyFileKey": "sa.json"}},
           "inference": INFERENCE},
    "az": {"model": {"source": "az://acct/models/flux/", "credentials": {
               "secretName": SECRET, "sasTokenKey": ""}},
           "inference": INFERENCE},
    "az-https": {"model": {"source": "https://acct.blob.core.windows.net/models/flux/"},
                 "inference": INFERENCE},
    "https": {"model": {"source": "https://cdn.example.com/models/flux/", "credentials": {
                  "secretName": SECRET, "bearerTokenKey": "token"}},
              "inference": INFERENCE},
    "hf": {"model": {"source": "hf://black-forest-labs/FLUX.1-dev@0ef5fff/", "credentials": {
               "secretName": SECRET}},
           "inference": INFERENCE},
}
"""Keyed by a case name; `az-https` names no Secret (a public container)."""
