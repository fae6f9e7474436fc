"""Each source scheme through the DOD: it passes the CRD and the operator's admission, and its
loader, alone, gets the credentials its DOD names (as references, never values) or its share
mounted read-only; what a DOD may not reach is refused with the field named."""

from __future__ import annotations

from typing import Any

import pytest
from support.source_specs import SCHEME_SPECS, SECRET

from dlo_contract.source_credentials import SCHEME_CREDENTIALS, Scheme
from dlo_operator.admission import admit
from dlo_operator.errors import SpecError
from dlo_operator.installation import InstallationConfig
from dlo_operator.manifests import build_children
from dlo_operator.naming import Owner, fill_secret_name
from dlo_operator.prefill import build_prefill_job
from dlo_operator.source_access import SECRET_VARS

OWNER = Owner(name="flux", namespace="ml", uid="uid-1")


def _document(spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "dlo.dev/v1alpha1", "kind": "DiffusionOffloadDeployment",
            "metadata": {"name": "flux", "namespace": "ml"}, "spec": spec}


def _pods(spec: dict[str, Any], installation: InstallationConfig = InstallationConfig(),
          ) -> list[dict[str, Any]]:
    """The StatefulSet's and the prefill Job's pod specs of an admitted DOD."""
    admitted = admit(_document(spec), installation)
    sts = build_children(OWNER, admitted)[3]
    job = build_prefill_job(OWNER, admitted, ["node-a"])
    return [sts["spec"]["template"]["spec"], job["spec"]["template"]["spec"]]


def _loader(pod: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in [*pod.get("initContainers", ()), *pod["containers"]]
                if c["name"] == "loader")


def _credentials(container: dict[str, Any]) -> dict[str, Any]:
    every = {name for c in SCHEME_CREDENTIALS.values() for name in c.env}
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", ())
            if e["name"] in every}


def _ref(key: str, optional: bool = False) -> dict[str, Any]:
    return {"secretKeyRef": {"name": SECRET, "key": key, "optional": optional}}


EXPECTED: dict[str, dict[str, Any]] = {
    "s3": {"AWS_ACCESS_KEY_ID": _ref("AWS_ACCESS_KEY_ID"),
           "AWS_SECRET_ACCESS_KEY": _ref("AWS_SECRET_ACCESS_KEY"),
           "AWS_SESSION_TOKEN": _ref("AWS_SESSION_TOKEN", True)},
    "file-pvc": {}, "file-nfs": {},
    "gs": {"GOOGLE_APPLICATION_CREDENTIALS": "/var/run/secrets/dlo/source/key.json"},
    "az": {"AZURE_STORAGE_CONNECTION_STRING": _ref("AZURE_STORAGE_CONNECTION_STRING", True),
           "AZURE_STORAGE_KEY": _ref("AZURE_STORAGE_KEY", True)},
    "az-https": {},
    "https": {"DLO_HTTPS_TOKEN": _ref("token")},
    "hf": {"HF_TOKEN": _ref("HF_TOKEN")},
}


@pytest.mark.parametrize("case", SCHEME_SPECS)
def test_each_scheme_passes_admission_and_its_loader_alone_gets_its_credentials(
        case: str) -> None:
    for pod in _pods(SCHEME_SPECS[case]):
        assert _credentials(_loader(pod)) == EXPECTED[case]
        for container in pod["containers"]:
            if container["name"] != "loader":
                assert _credentials(container) == {}


def test_every_scheme_with_a_secret_passes_only_its_own_variables() -> None:
    """The table of Secret variables names each scheme's contract variables, no other's."""
    for scheme, variables in SECRET_VARS.items():
        assert {v.env for v in variables} == set(SCHEME_CREDENTIALS[scheme].env), scheme
    assert set(SECRET_VARS) | {Scheme.GS, Scheme.FILE} == set(Scheme)


def test_a_gcs_key_file_is_a_read_only_secret_volume_of_the_loader_only() -> None:
    for pod in _pods(SCHEME_SPECS["gs"]):
        (volume,) = [v for v in pod["volumes"] if v["name"] == "source-credentials"]
        assert volume == {"name": "source-credentials", "secret": {
            "secretName": SECRET, "items": [{"key": "sa.json", "path": "key.json"}]}}
        mounted = [(c["name"], m) for c in [*pod.get("initContainers", ()), *pod["containers"]]
                   for m in c["volumeMounts"] if m["name"] == "source-credentials"]
        assert mounted == [("loader", {"name": "source-credentials", "readOnly": True,
                                       "mountPath": "/var/run/secrets/dlo/source"})]


@pytest.mark.parametrize(("case", "volume", "path"), [("file-pvc", "weights", "/models"),
                                                       ("file-nfs", "nfs", "/mnt/share")])
def test_a_file_share_is_mounted_read_only_into_the_loader_only(
        case: str, volume: str, path: str) -> None:
    for pod in _pods(SCHEME_SPECS[case]):
        mounted = [(c["name"], m) for c in [*pod.get("initContainers", ()), *pod["containers"]]
                   for m in c["volumeMounts"] if m["name"] == volume]
        assert mounted == [("loader", {"name": volume, "mountPath": path, "readOnly": True})]


def test_no_rendered_manifest_holds_a_secret_value() -> None:
    """Credentials are references: the manifests name the Secret and its keys, nothing else.
    The one Secret among them is the DOD's fill Secret, rendered without data (the operator
    writes its random bytes when it creates it)."""
    for case, spec in SCHEME_SPECS.items():
        for child in build_children(OWNER, admit(_document(spec))):
            assert "stringData" not in child and "data" not in (
                child if child["kind"] == "Secret" else {}), case
            if child["kind"] == "Secret":
                assert child["metadata"]["name"] == fill_secret_name(OWNER.name), case


FILE_SPEC = SCHEME_SPECS["file-pvc"]


def _refusal(spec: dict[str, Any], installation: InstallationConfig = InstallationConfig(),
             ) -> str:
    with pytest.raises(SpecError) as caught:
        admit(_document(spec), installation)
    return str(caught.value)


def test_a_file_source_without_a_share_is_refused_naming_the_field() -> None:
    spec = {**FILE_SPEC, "model": {"source": "file:///models/flux/"}}
    assert "[source-share] a file:/// spec.model.source reads a share the loader mounts, but " \
        "spec.model.share.volumeName names none" in _refusal(spec)


def test_a_share_that_is_no_volume_of_the_dod_is_refused() -> None:
    spec = {**FILE_SPEC, "volumes": []}
    assert _refusal(spec) == (
        "[source-share-volume] spec.model.share.volumeName='weights' is not one of "
        "spec.volumes; fix: add the share's volume (a persistentVolumeClaim or nfs volume) to "
        "spec.volumes under that name")


def test_a_file_source_outside_its_share_is_refused() -> None:
    spec = {**FILE_SPEC, "model": {"source": "file:///etc/flux/",
                                   "share": {"volumeName": "weights"}}}
    assert _refusal(spec) == (
        "[source-share-path] spec.model.source='file:///etc/flux/' lies outside "
        "spec.model.share.mountPath='/models'; fix: write the source as "
        "file:///models/<directory>/ or move the mount")


def test_a_share_over_the_loader_s_own_mounts_is_refused() -> None:
    spec = {**FILE_SPEC, "model": {"source": "file:///var/lib/dlo/cache/x/",
                                   "share": {"volumeName": "weights",
                                             "mountPath": "/var/lib/dlo"}}}
    assert "[source-share-path] spec.model.share.mountPath='/var/lib/dlo' overlaps the " \
        "loader's mount path '/var/lib/dlo/cache'" in _refusal(spec)
    # Nor over the DOD's fill secret, which the loader mounts (issue 43).
    over_secret = {**FILE_SPEC, "model": {"source": "file:///run/dlo-fill-secret/m/",
                                          "share": {"volumeName": "weights",
                                                    "mountPath": "/run/dlo-fill-secret"}}}
    assert "[source-share-path] spec.model.share.mountPath='/run/dlo-fill-secret' overlaps " \
        "the loader's mount path '/run/dlo-fill-secret'" in _refusal(over_secret)


def test_a_share_for_another_scheme_is_refused() -> None:
    spec = {**SCHEME_SPECS["s3"], "model": {"source": "s3://models/flux/",
                                            "share": {"volumeName": "weights"}}}
    assert _refusal(spec) == (
        "[source-share-scheme] spec.model.share.volumeName='weights' is only read by a "
        "file:/// source, and spec.model.source is s3://; fix: remove spec.model.share")


def test_a_host_path_share_only_under_the_platform_s_allowlist() -> None:
    spec = {**FILE_SPEC, "volumes": [{"name": "weights", "hostPath": {"path": "/srv/models"}}]}
    assert "spec.volumes[0].hostPath.path='/srv/models' is not under a node directory" in \
        _refusal(spec)
    allowed = InstallationConfig(allowed_user_host_paths=("/srv",))
    (loader_mounts,) = {tuple(m["name"] for m in _loader(pod)["volumeMounts"])
                        for pod in _pods(spec, allowed)}
    assert "weights" in loader_mounts


def test_a_source_of_no_scheme_is_refused_by_the_crd_with_the_forms() -> None:
    spec = {**SCHEME_SPECS["s3"], "model": {"source": "ftp://models/flux/"}}
    assert "spec.model.source" in _refusal(spec)
    assert "hf://org/repo[@revision]/" in _refusal(spec)
