"""What a DOD author could reach that is not theirs through the pod the operator builds.

The node cache reaches a pod only as the operator's own volume (`node-cache`, the pod's claim of
its namespace's directory): the loader mounts its `cache/` writable, the server mounts it
read-only and, with the runtime cache, its own DOD's `runtime/<dod>`. A DOD author writes the
server's extra mounts (`inference.volumeMounts`) and volumes (`volumes`); neither may name the
operator's volume, so no mount of theirs reaches the entries writable, the namespace's whole
directory, or another DOD's runtime cache. The paths a DOD sets for the cache are paths inside
the containers: naming another namespace's node directory there mounts nothing of it.
"""

from __future__ import annotations

from typing import Any

import pytest
from support.operator_harness import NAMESPACE

from dlo_operator.errors import SpecError
from dlo_operator.installation import InstallationConfig
from dlo_operator.pod import CACHE_VOLUME
from dlo_operator.render import render_document


def render(spec: dict[str, Any]) -> list[dict[str, Any]]:
    document = {"apiVersion": "dlo.dev/v1alpha1", "kind": "DiffusionOffloadDeployment",
                "metadata": {"name": "flux", "namespace": NAMESPACE},
                "spec": {"model": {"source": "s3://models/flux/"}, **spec}}
    return list(render_document(document, NAMESPACE, InstallationConfig()))


def server(mounts: list[dict[str, Any]], volumes: list[dict[str, Any]] | None = None
           ) -> dict[str, Any]:
    spec: dict[str, Any] = {"inference": {"image": "server:1", "volumeMounts": mounts}}
    if volumes is not None:
        spec["volumes"] = volumes
    return spec


@pytest.mark.parametrize("mount", [
    {"name": CACHE_VOLUME, "mountPath": "/all"},
    {"name": CACHE_VOLUME, "mountPath": "/entries", "subPath": "cache"},
    {"name": CACHE_VOLUME, "mountPath": "/theirs", "subPath": "runtime/wan"},
], ids=["whole-namespace-directory", "entries-writable", "another-dods-runtime-cache"])
def test_a_server_mount_of_the_operators_cache_volume_is_refused(mount: dict[str, Any]) -> None:
    with pytest.raises(SpecError, match=r"\[volume-mounts-known\] spec\.inference\.volumeMounts "
                                        rf"mounts '{CACHE_VOLUME}', which spec\.volumes does not "
                                        "define"):
        render(server([mount]))


def test_a_volume_of_the_dods_own_named_as_the_cache_volume_is_refused() -> None:
    claim = {"name": CACHE_VOLUME, "persistentVolumeClaim": {"claimName": "mine"}}
    with pytest.raises(SpecError, match=rf"\[volume-names\] spec\.volumes names '{CACHE_VOLUME}'"):
        render(server([{"name": CACHE_VOLUME, "mountPath": "/x"}], [claim]))


def test_naming_another_namespaces_node_directory_as_the_cache_path_mounts_nothing_of_it() -> None:
    """`cache.hostPath` is where the containers see their own namespace's cache: set to the node
    path of another namespace's directory, it is still the pod's own claim mounted there."""
    theirs = "/var/lib/dlo/namespaces/other-team/cache"
    children = render({"inference": {"image": "server:1"}, "cache": {"hostPath": theirs}})
    [sts] = [c for c in children if c["kind"] == "StatefulSet"]
    pod = sts["spec"]["template"]["spec"]
    assert not [v for v in pod["volumes"] if "hostPath" in v]
    [cache] = [v for v in pod["volumes"] if v["name"] == CACHE_VOLUME]
    assert set(cache) == {"name", "ephemeral"}
    for container in [*pod["initContainers"], *pod["containers"]]:
        reach = [(m.get("subPath", ""), m["mountPath"]) for m in container["volumeMounts"]
                 if m["name"] == CACHE_VOLUME]
        assert reach == [("cache", theirs)]
