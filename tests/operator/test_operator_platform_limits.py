"""Issue 33's platform-owned limits: a DOD cannot mount the node's files (attack 3), run a loader
image the platform did not choose with the node cache writable (attack 6), or set the node
cache's limit for every team on the node (attack 7). Each is refused by `dlo render` and by the
operator (in the API emulator, with the installation the chart would pass) with one message that
names the field as the user wrote it, the value and the chart value that governs it. The default
installation's refusals of attacks 3 and 6 also run through `support.bad_crs`' table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kopf
import pytest
from support.operator_harness import (
    DOD_PATH,
    DOD_RESOURCE,
    NAMESPACE,
    ClusterEmulator,
    eventually,
    live,
    operator_with,
    request,
)

from dlo_cli import main as cli
from dlo_operator.errors import SpecError
from dlo_operator.host_paths import within
from dlo_operator.installation import InstallationConfig
from dlo_operator.naming import SETTINGS_KEY
from dlo_operator.render import render_document

GIB = 1 << 30
PLATFORM = InstallationConfig(
    loader_image="registry.example.com/dlo-loader:1.2.3",
    allowed_loader_images=("registry.example.com/dlo-loader@sha256:" + "ab" * 32,),
    allowed_user_host_paths=("/mnt/datasets",),
    node_cache_max_bytes=500 * GIB, node_cache_min_free_bytes=20 * GIB)
"""An installation with every platform value set (the chart's values as flags)."""

HOST_ROOT = {"volumes": [{"name": "h", "hostPath": {"path": "/"}}],
             "inference": {"image": "server:1", "volumeMounts": [{"name": "h",
                                                                  "mountPath": "/host"}]}}
HOST_ROOT_MESSAGE = (
    "spec.volumes[0].hostPath.path='/' is not under a node directory the platform lets DODs "
    "mount (chart value allowedUserHostPaths; {allowed}); use another volume type (emptyDir, "
    "persistentVolumeClaim, configMap, secret), or ask the cluster administrator to add a "
    "directory to allowedUserHostPaths")
EVIL_LOADER = {"loader": {"image": "evil.example.com/miner:latest"}}
EVIL_LOADER_MESSAGE = (
    "spec.loader.image='evil.example.com/miner:latest' is not a loader image the platform "
    "allows (chart values loaderImage and allowedLoaderImages: {allowed}); the loader writes "
    "the node cache other pods map, so it runs only code the platform chose: leave "
    "spec.loader.image empty to use {default}, or ask the cluster administrator to add the "
    "image to allowedLoaderImages")
GREEDY = {"cache": {"maxBytes": 600 * GIB}}
GREEDY_MESSAGE = (
    f"spec.cache.maxBytes={600 * GIB} is more than the node cache's limit of {500 * GIB} bytes "
    "that the platform sets for every DOD on the node (chart value nodeCache.maxBytes); ask for "
    f"at most {500 * GIB}, or 0 to take the limit")
LOW_FLOOR = {"cache": {"minFreeBytes": GIB}}
LOW_FLOOR_MESSAGE = (
    f"spec.cache.minFreeBytes={GIB} is less than the free space of {20 * GIB} bytes that the "
    "platform keeps on every node cache (chart value nodeCache.minFreeBytes); ask for "
    f"{20 * GIB} or more, or 0 to take it")
OUTSIDE_PREFIX_MESSAGE = (
    "spec.{field}={path!r} is not under {prefix}, the directory the platform sets aside for "
    "the node cache in the containers (chart value cachePathPrefix); mounted writable elsewhere, "
    "the cache could shadow the programs and libraries a container runs (the loader's PATH and "
    "library path, e.g. /usr/local/bin): choose a directory under {prefix}")
RUNTIME_CACHE = {"useAllgather": False, "enableRuntimeCache": True}
POD_CLAIM = [{"name": "c", "persistentVolumeClaim": {"claimName": "flux-0-node-cache"}}]
POD_CLAIM_MESSAGE = (
    "spec.volumes[0].persistentVolumeClaim.claimName='flux-0-node-cache' names a pod's "
    "node-cache claim (every claim named <pod>-node-cache may be one), which only the operator's "
    "own volumes may mount (the node cache reaches a DOD's containers read-only, through them); "
    "name another claim")
NODE_CACHE_CLASS_MESSAGE = (
    "spec.volumes[0].ephemeral.volumeClaimTemplate.spec.storageClassName='dlo-node-cache' is the "
    "node cache's class, which only the operator's own volumes may claim (the node cache reaches "
    "a DOD's containers read-only, through them); choose another StorageClass")
ISSUE_43_ATTACKS = [
    pytest.param({"cache": {"hostPath": path}},
                 OUTSIDE_PREFIX_MESSAGE.format(field="cache.hostPath", path=path,
                                               prefix="/var/lib/dlo"),
                 id=f"43-cache-host-path{path.replace('/', '-')}")
    for path in ("/usr/local/bin", "/var/lib/dlo-evil")
] + [
    pytest.param({"offload": {**RUNTIME_CACHE, "runtimeCacheRoot": path}},
                 OUTSIDE_PREFIX_MESSAGE.format(field="offload.runtimeCacheRoot", path=path,
                                               prefix="/var/lib/dlo"),
                 id=f"43-runtime-cache-root{path.replace('/', '-')}")
    for path in ("/usr/local/bin", "/var/lib/dlo-evil")
] + [
    pytest.param({"volumes": POD_CLAIM}, POD_CLAIM_MESSAGE, id="43-pod-cache-claim"),
    pytest.param({"volumes": POD_CLAIM, "model": {"source": "file:///models/flux/",
                                                  "share": {"volumeName": "c"}}},
                 POD_CLAIM_MESSAGE, id="43-share-pod-cache-claim"),
    pytest.param({"volumes": [{"name": "c", "ephemeral": {"volumeClaimTemplate": {"spec": {
        "storageClassName": "dlo-node-cache", "accessModes": ["ReadWriteOncePod"],
        "resources": {"requests": {"storage": "1Gi"}}}}}}],
        "model": {"source": "file:///models/flux/", "share": {"volumeName": "c"}}},
        NODE_CACHE_CLASS_MESSAGE, id="43-share-node-cache-class"),
]
"""Issue 43: a cache path on the loader's PATH (the loader's `dlo` would resolve into the
writable cache, past `allowedLoaderImages`) or beside the prefix, and a volume or `model.share`
that is a pod's node-cache claim or a claim of its class."""
ATTACKS = [
    pytest.param(HOST_ROOT, HOST_ROOT_MESSAGE.format(allowed="allowed: /mnt/datasets"),
                 id="3-host-root"),
    pytest.param(EVIL_LOADER, EVIL_LOADER_MESSAGE.format(
        allowed=", ".join(PLATFORM.loader_images), default=PLATFORM.loader_image),
        id="6-loader-image"),
    pytest.param(GREEDY, GREEDY_MESSAGE, id="7-cache-max-bytes"),
    pytest.param(LOW_FLOOR, LOW_FLOOR_MESSAGE, id="7-cache-min-free-bytes"),
    *ISSUE_43_ATTACKS,
]


def document(spec: dict[str, Any], name: str = "flux") -> dict[str, Any]:
    return {"apiVersion": "dlo.dev/v1alpha1", "kind": "DiffusionOffloadDeployment",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"model": {"source": "s3://models/flux/"},
                     "inference": {"image": "server:1"}, **spec}}


def refusal(spec: dict[str, Any], installation: InstallationConfig = PLATFORM) -> str:
    with pytest.raises(SpecError) as info:
        list(render_document(document(spec), NAMESPACE, installation))
    return str(info.value).removeprefix(f"{NAMESPACE}/flux: ")


def settings_of(spec: dict[str, Any], installation: InstallationConfig) -> dict[str, Any]:
    """The settings document the pods of `spec` read."""
    children = render_document(document(spec), NAMESPACE, installation)
    return json.loads(next(c["data"][SETTINGS_KEY] for c in children if c["kind"] == "ConfigMap"
                           and SETTINGS_KEY in c.get("data", {})))


@pytest.mark.parametrize(("spec", "message"), ATTACKS)
def test_render_refuses_each_attack_naming_field_value_and_chart_value(
        spec: dict[str, Any], message: str) -> None:
    assert refusal(spec) == message


def test_dlo_render_takes_the_platforms_flags(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "dod.yaml"
    path.write_text(json.dumps(document(GREEDY)))
    flags = ["--node-cache-max-bytes", str(500 * GIB)]
    assert cli.main(["render", str(path), *flags]) == 1
    assert f"dlo: error: {NAMESPACE}/flux: {GREEDY_MESSAGE}" in capsys.readouterr().err
    assert cli.main(["render", str(path), "--node-cache-max-bytes", str(600 * GIB)]) == 0


@pytest.mark.parametrize(("spec", "message"), [
    pytest.param(HOST_ROOT, HOST_ROOT_MESSAGE.format(allowed="none is allowed"), id="root"),
    pytest.param({"volumes": [{"name": "k", "hostPath": {"path": "/var/lib/kubelet"}}]},
                 HOST_ROOT_MESSAGE.format(allowed="none is allowed").replace(
                     "'/'", "'/var/lib/kubelet'"), id="kubelet"),
    pytest.param(EVIL_LOADER, EVIL_LOADER_MESSAGE.format(allowed="dlo-loader:0.1.0",
                                                         default="dlo-loader:0.1.0"),
                 id="loader-image"),
])
def test_the_defaults_allow_no_host_path_and_only_the_charts_loader(
        spec: dict[str, Any], message: str) -> None:
    assert refusal(spec, InstallationConfig()) == message


@pytest.mark.parametrize(("volume", "message"), [
    ({"hostPath": {"path": "/mnt/datasets-evil"}},
     "spec.volumes[0].hostPath.path='/mnt/datasets-evil' is not under a node directory"),
    ({"hostPath": {"path": "/mnt/datasets/../../etc"}},
     "spec.volumes[0].hostPath.path='/mnt/datasets/../../etc' must be an absolute, normalized "
     "path (no '.', '..', '//' or trailing '/')"),
    ({"hostPath": {"path": "/mnt"}}, "spec.volumes[0].hostPath.path='/mnt' is not under"),
    ({"gitRepo": {"repository": "https://example.com/x.git"}},
     "spec.volumes[0].gitRepo is refused: the kubelet runs git on the node, as root, with the "
     "repository the pod names (CVE-2024-10220); clone it in an init container into an "
     "emptyDir instead"),
    ({"ephemeral": {"volumeClaimTemplate": {"spec": {
        "storageClassName": "dlo-node-cache", "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": "1Gi"}}}}}},
     "spec.volumes[0].ephemeral.volumeClaimTemplate.spec.storageClassName='dlo-node-cache' is "
     "the node cache's class, which only the operator's own volumes may claim (the node cache "
     "reaches a DOD's containers read-only, through them); choose another StorageClass"),
    ({"flexVolume": {"driver": "example.com/lvm"}},
     "spec.volumes[0].flexVolume is refused: the kubelet runs the node's driver program with "
     "the options the pod gives; use a CSI volume or a persistentVolumeClaim instead"),
])
def test_user_volumes_reach_the_node_only_where_the_platform_allows(
        volume: dict[str, Any], message: str) -> None:
    assert refusal({"volumes": [{"name": "v", **volume}]}).startswith(message)


def test_an_allowed_user_host_path_is_rendered_and_may_not_reach_the_node_cache() -> None:
    allowed = {"volumes": [{"name": "d", "hostPath": {"path": "/mnt/datasets/team-a"}},
                           {"name": "e", "emptyDir": {}}],
               "inference": {"image": "server:1", "volumeMounts": [
                   {"name": "d", "mountPath": "/data", "readOnly": True}]}}
    children = {c["kind"]: c for c in render_document(document(allowed), NAMESPACE, PLATFORM)}
    volumes = children["StatefulSet"]["spec"]["template"]["spec"]["volumes"]
    assert {"name": "d", "hostPath": {"path": "/mnt/datasets/team-a"}} in volumes
    platform = InstallationConfig(allowed_user_host_paths=("/var/lib", "/mnt"),
                                  allowed_host_paths=("/mnt/cache",),
                                  node_cache_root="/var/lib/dlo")
    assert refusal({"volumes": [{"name": "c", "hostPath": {"path": "/var/lib/dlo/namespaces"}},
                                {"name": "m", "hostPath": {"path": "/mnt"}}]}, platform) == (
        "spec.volumes[0].hostPath.path='/var/lib/dlo/namespaces' overlaps the node cache "
        "directory '/var/lib/dlo' (chart value nodeCache.hostPath), which pods reach only through "
        "the operator's own volumes; mount a directory outside it; "
        "spec.volumes[1].hostPath.path='/mnt' overlaps the node cache directory '/mnt/cache' "
        "(chart value allowedHostPaths), which pods reach only through the operator's own "
        "volumes; mount a directory outside it")


def test_host_paths_are_compared_as_paths_not_strings() -> None:
    """`/var/lib/dlo-evil` shares a string prefix with `/var/lib/dlo` but lies outside it: the
    DODs' own allowlist (`allowedUserHostPaths`)."""
    assert within("/var/lib/dlo/cache", "/var/lib/dlo") and within("/var/lib/dlo", "/var/lib/dlo")
    assert not within("/var/lib/dlo-evil", "/var/lib/dlo")
    assert refusal({"volumes": [{"name": "d", "hostPath": {"path": "/mnt/datasets-evil"}}]}) == (
        "spec.volumes[0].hostPath.path='/mnt/datasets-evil' is not under a node directory the "
        "platform lets DODs mount (chart value allowedUserHostPaths; allowed: /mnt/datasets); use "
        "another volume type (emptyDir, persistentVolumeClaim, configMap, secret), or ask the "
        "cluster administrator to add a directory to allowedUserHostPaths")


def test_an_allowed_loader_image_is_the_whole_reference() -> None:
    digest = PLATFORM.allowed_loader_images[0]
    children = render_document(document({"loader": {"image": digest}}), NAMESPACE, PLATFORM)
    sts = next(c for c in children if c["kind"] == "StatefulSet")
    assert sts["spec"]["template"]["spec"]["initContainers"][0]["image"] == digest
    near = "registry.example.com/dlo-loader:1.2.3-evil"
    assert refusal({"loader": {"image": near}}).startswith(f"spec.loader.image={near!r} is not")


@pytest.mark.parametrize(("cache", "effective"), [
    ({}, {"max_bytes": 500 * GIB, "min_free_bytes": 20 * GIB}),
    ({"maxBytes": 1}, {"max_bytes": 1, "min_free_bytes": 20 * GIB}),
    ({"maxBytes": 100 * GIB, "minFreeBytes": 30 * GIB},
     {"max_bytes": 100 * GIB, "min_free_bytes": 30 * GIB}),
])
def test_the_pods_settings_carry_the_node_limits_and_the_dods_own_asks(
        cache: dict[str, int], effective: dict[str, int]) -> None:
    """A DOD's `cache.maxBytes` (even 1, attack 7) is its own entry's cap: the node's limits,
    which alone evict, are the platform's (the loader side: tests/loader)."""
    written = settings_of({"cache": cache}, PLATFORM)["cache"]
    assert written == {**written, **effective, "node_max_bytes": 500 * GIB,
                       "node_min_free_bytes": 20 * GIB}


def operator_of(installation: InstallationConfig) -> Any:
    """The operator as `dlo operator run` starts it with the chart's flags."""
    return operator_with(kopf.Memo(installation=installation))


async def test_the_operator_refuses_each_attack_as_render_does(
        cluster: ClusterEmulator) -> None:
    attacks = [(f"attack-{index}", param.values[0], param.values[1])
               for index, param in enumerate(ATTACKS)]

    def valid(name: str) -> dict[str, str] | None:
        status = live(cluster, DOD_RESOURCE, name).get("status") or {}
        return next((c for c in status.get("conditions", ()) if c["type"] == "Valid"), None)

    async with operator_of(PLATFORM):
        for name, spec, _ in attacks:
            await request(cluster, "POST", DOD_PATH, document(spec, name))
        for name, _, message in attacks:
            condition = await eventually(lambda name=name: valid(name))
            assert (condition["status"], condition["reason"], condition["message"]) == (
                "False", "SpecInvalid", message), name

        def warned(name: str, message: str) -> bool:
            """A Warning Event on DOD `name` says `message`."""
            return any(r.data["involvedObject"]["name"] == name and r.data["type"] == "Warning"
                       and r.data["reason"] == "SpecInvalid" and r.data["message"] == message
                       for r in list(cluster) if r.resource is not None
                       and r.resource.plural == "events" and r.method == "POST")

        for name, _, message in attacks:
            assert await eventually(lambda name=name, message=message: warned(name, message))
    assert not [r for r in list(cluster) if r.resource is not None
                and r.resource.plural in ("configmaps", "services", "statefulsets", "jobs")
                and r.method in ("POST", "PATCH", "PUT", "DELETE")]


@pytest.mark.parametrize("field", ["cache.hostPath", "offload.runtimeCacheRoot"])
def test_a_cache_path_climbing_out_of_the_prefix_is_refused_as_written(field: str) -> None:
    """`/var/lib/dlo/../../usr/bin` starts with the prefix as a string; it is refused as not
    normalized (the CRD's pattern) before any comparison, so `..` never reaches one."""
    path = "/var/lib/dlo/../../usr/bin"
    section, key = field.split(".")
    spec = {section: {key: path, **(RUNTIME_CACHE if section == "offload" else {})}}
    assert refusal(spec).startswith(f"spec.{field}: {path!r} does not match ")


def test_the_cache_path_prefix_is_the_platforms_and_never_holds_the_loaders_code(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    platform = InstallationConfig(cache_path_prefix="/mnt/nvme")
    children = render_document(document({"cache": {"hostPath": "/mnt/nvme/cache"}}), NAMESPACE,
                               platform)
    assert [c["kind"] for c in children if c["kind"] == "StatefulSet"] == ["StatefulSet"]
    assert refusal({}, platform) == OUTSIDE_PREFIX_MESSAGE.format(
        field="cache.hostPath", path="/var/lib/dlo/cache", prefix="/mnt/nvme")
    path = tmp_path / "dod.yaml"
    path.write_text(json.dumps(document({})))
    for prefix, clash in (("/usr/local", "/usr"), ("/", None), ("/opt/dlo", "/opt")):
        with pytest.raises(SystemExit) as exited:
            cli.main(["render", str(path), f"--cache-path-prefix={prefix}"])
        assert exited.value.code == 2
        error = capsys.readouterr().err.splitlines()[-1]
        if clash is None:
            assert error.endswith(f"argument --cache-path-prefix: {prefix!r} is not an absolute, "
                                  "normalized directory; pass one like /var/lib/dlo (no '.', "
                                  "'..', '//' or trailing '/')")
        else:
            assert error.endswith(
                f"argument --cache-path-prefix: {prefix!r} overlaps {clash}, where the loader "
                "image finds its programs or libraries; the loader mounts the cache writable "
                "there, so pass a directory of its own, like /var/lib/dlo")
    assert cli.main(["render", str(path), "--cache-path-prefix=/var/lib/dlo"]) == 0
