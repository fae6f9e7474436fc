"""The node agent: it prepares a namespace's node-cache directory (root's tree, `cache/` the
loader's non-root user's, mode 0755) before the kubelet may mount it, idempotently, from the
PersistentVolume's own spec alone, never following a symlink; and, run against the API emulator,
it prepares the directories of its own node's volumes of the node-cache provisioner only, and
with the operator, end to end, the directory a DOD pod's claim gets.
Tests run as root here, so chown works as it does in the agent's container (uid 0, CAP_CHOWN)."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path
from typing import Any

import kmock
import pytest
from kopf.testing import KopfRunner

from dlo_cli.main import main
from dlo_operator import handlers
from dlo_operator.installation import InstallationConfig
from dlo_operator.node_agent import NodeAgentConfig, build_registry, prepare_volume
from dlo_operator.node_cache import (
    NODE_ANNOTATION,
    SELECTED_NODE,
    Claim,
    NodeCacheConfig,
    build_persistent_volume,
)
from dlo_operator.node_directories import NodeDirectoryError, namespace_of, prepare
from dlo_operator.node_handover import Owner
from support.operator_harness import (
    DOD_PATH,
    NAMESPACE,
    ClusterEmulator,
    Operator,
    eventually,
    live,
    request,
    used_rules,
)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")

LOADER = Owner(65532, 65532)
AGENT_RULES = {"persistentvolumes": {"get", "list", "watch"}}
"""What the chart grants the agent (tests/chart/test_chart.py checks the chart says so)."""


def owner_and_mode(path: Path) -> tuple[int, int, int]:
    info = os.lstat(path)
    assert stat.S_ISDIR(info.st_mode), path
    return info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)


def volume_of(namespace: str, node: str, root: str, uid: str = "u-1") -> dict[str, Any]:
    claim = Claim(namespace=namespace, name="flux-0-node-cache", uid=uid, node=node,
                  storage="1Gi", access_modes=("ReadWriteOncePod",))
    return build_persistent_volume(claim, node, NodeCacheConfig(root=root))


def test_prepare_makes_the_tree_with_its_owners_and_modes_and_is_idempotent(
        tmp_path: Path) -> None:
    assert prepare(str(tmp_path), "team-a", LOADER) is True
    directory = tmp_path / "namespaces" / "team-a"
    assert owner_and_mode(tmp_path / "namespaces") == (0, 0, 0o755)
    assert owner_and_mode(directory) == (0, 0, 0o755)
    assert owner_and_mode(directory / "cache") == (65532, 65532, 0o755)
    assert owner_and_mode(directory / "runtime") == (0, 0, 0o755)
    assert sorted(os.listdir(tmp_path / "namespaces")) == ["team-a"]  # no staging left
    (directory / "cache" / "entry").mkdir()  # what a loader wrote stays as it is
    assert prepare(str(tmp_path), "team-a", LOADER) is False
    assert owner_and_mode(directory / "cache") == (65532, 65532, 0o755)
    assert os.listdir(directory / "cache") == ["entry"]


def test_prepare_repairs_a_root_owned_directory_of_an_older_operator(tmp_path: Path) -> None:
    """`DirectoryOrCreate` made the namespace's directory, the kubelet its `cache/` (root's,
    0750 as the subPath's parent); and a stopped agent left its staging directory."""
    (tmp_path / "namespaces" / "team-a" / "cache").mkdir(parents=True, mode=0o750)
    (tmp_path / "namespaces" / ".team-b.staging" / "cache").mkdir(parents=True)
    assert prepare(str(tmp_path), "team-a", LOADER) is False
    assert prepare(str(tmp_path), "team-b", LOADER) is True
    for namespace in ("team-a", "team-b"):
        assert owner_and_mode(tmp_path / "namespaces" / namespace / "cache") == (
            65532, 65532, 0o755)
    assert sorted(os.listdir(tmp_path / "namespaces")) == ["team-a", "team-b"]


def test_a_cache_that_changes_hands_gives_its_contents_but_no_link_target(
        tmp_path: Path) -> None:
    """Entries a root loader wrote before the upgrade become the loader's (it must evict and
    replace them); a symlink and a hard link below `cache/` are left, and so are their targets."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    cache = root / "namespaces" / "team-a" / "cache"
    entry = cache / "v1" / "entries" / "e1"
    entry.mkdir(parents=True)
    (entry / "w.bin").write_bytes(b"w")
    (entry / "w.bin").chmod(0o444)
    outside.mkdir()
    (outside / "secret").write_bytes(b"s")
    (cache / "v1" / "link").symlink_to(outside, target_is_directory=True)
    os.link(outside / "secret", cache / "v1" / "hard")
    assert prepare(str(root), "team-a", LOADER) is False
    for path in (cache / "v1", cache / "v1" / "entries", entry, entry / "w.bin"):
        assert (os.lstat(path).st_uid, os.lstat(path).st_gid) == (65532, 65532), path
    for path in (outside, outside / "secret", cache / "v1" / "link"):
        assert os.lstat(path).st_uid == 0, path
    assert stat.S_IMODE(os.lstat(entry / "w.bin").st_mode) == 0o444


@pytest.mark.parametrize("planted", ["namespaces", "namespaces/team-a",
                                     "namespaces/team-a/cache"])
def test_a_planted_symlink_is_refused_never_followed(tmp_path: Path, planted: str) -> None:
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    (elsewhere / "cache").mkdir(parents=True, mode=0o700)
    link = root / planted
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(elsewhere, target_is_directory=True)
    before = {path: owner_and_mode(path) for path in (elsewhere, elsewhere / "cache")}
    with pytest.raises(NodeDirectoryError) as refused:
        prepare(str(root), "team-a", LOADER)
    assert str(refused.value) == (
        f"{link} is not a directory (a symlink or a file): refused, the node agent never "
        "follows a link below the node cache's root")
    assert refused.value.hint == (
        f"remove {link} on the node (nothing but the agent creates it), and the agent "
        "prepares it at the volume's next event or its own restart")
    assert {path: owner_and_mode(path) for path in before} == before
    assert sorted(os.listdir(elsewhere)) == ["cache"]


@pytest.mark.parametrize(("path", "namespace"), [
    ("/etc", "team-a"),
    ("/var/lib/dlo/namespaces/team-a/../../../etc", "team-a"),
    ("/var/lib/dlo/namespaces/../namespaces/team-a", "team-a"),
    ("/var/lib/dlo/namespaces/team-b", "team-a"),
    ("/var/lib/dlo/namespaces/team-a/cache", "team-a"),
    ("/var/lib/dlo/namespaces/..", ".."),
    ("/var/lib/dlo-evil/namespaces/team-a", "team-a"),
], ids=["outside", "dotdot-out", "dotdot-in", "other-namespace", "deeper", "dotdot-namespace",
        "prefix"])
def test_a_volume_path_other_than_its_claims_namespace_directory_is_refused(
        path: str, namespace: str) -> None:
    pv = volume_of("team-a", "gpu-0", "/var/lib/dlo")
    pv["spec"]["hostPath"]["path"] = path
    pv["spec"]["claimRef"]["namespace"] = namespace
    with pytest.raises(NodeDirectoryError) as refused:
        namespace_of(pv, "/var/lib/dlo")
    assert str(refused.value) == (
        f"PersistentVolume {pv['metadata']['name']}: spec.hostPath.path={path!r} with "
        f"spec.claimRef.namespace={namespace!r} is not a node-cache directory; expected "
        "/var/lib/dlo/namespaces/<the claim's namespace>")


def test_only_this_nodes_volumes_of_the_provisioner_are_prepared(tmp_path: Path) -> None:
    config = NodeAgentConfig(node="gpu-0", root=str(tmp_path), owner=LOADER)
    assert prepare_volume(volume_of("team-a", "gpu-0", str(tmp_path)), config) == "team-a"
    assert prepare_volume(volume_of("team-b", "gpu-1", str(tmp_path)), config) is None
    foreign = volume_of("team-c", "gpu-0", str(tmp_path))
    foreign["metadata"]["annotations"]["pv.kubernetes.io/provisioned-by"] = "other.dev/csi"
    assert prepare_volume(foreign, config) is None
    assert os.listdir(tmp_path / "namespaces") == ["team-a"]


async def test_the_agent_prepares_its_nodes_volumes_against_the_api(
        cluster: ClusterEmulator, tmp_path: Path) -> None:
    """The operator's volumes of this node and another, and another provisioner's volume of this
    node: the agent prepares the first only, with only the verbs the chart grants it."""
    root = str(tmp_path)
    ours = volume_of("team-a", "gpu-0", root, uid="u-a")
    theirs = volume_of("team-b", "gpu-1", root, uid="u-b")
    foreign = volume_of("team-c", "gpu-0", root, uid="u-c")
    foreign["metadata"]["annotations"]["pv.kubernetes.io/provisioned-by"] = "other.dev/csi"
    foreign["spec"]["storageClassName"] = "standard"
    for pv in (theirs, foreign):
        await request(cluster, "POST", "/api/v1/persistentvolumes", pv)
    config = NodeAgentConfig(node="gpu-0", root=root, owner=LOADER)
    runner = KopfRunner(["run", "-A", "--standalone"], registry=build_registry(config),
                        timeout=30)
    await asyncio.to_thread(runner.__enter__)
    cache = tmp_path / "namespaces" / "team-a" / "cache"
    try:
        await request(cluster, "POST", "/api/v1/persistentvolumes", ours)
        await eventually(lambda: cache.is_dir() and owner_and_mode(cache))
    finally:
        await asyncio.to_thread(runner.__exit__, None, None, None)
    assert runner.exit_code == 0
    assert owner_and_mode(cache) == (65532, 65532, 0o755)
    assert os.listdir(tmp_path / "namespaces") == ["team-a"]
    assert ours["metadata"]["annotations"][NODE_ANNOTATION] == "gpu-0"
    requested = {(resource, verb) for (_, resource), verbs in used_rules(cluster).items()
                 for verb in verbs}
    granted = {(plural, verb) for plural, granted in AGENT_RULES.items() for verb in granted}
    assert {("persistentvolumes", "list"), ("persistentvolumes", "watch")} <= requested
    assert requested <= granted, requested


async def test_a_pods_claim_gets_a_prepared_directory_from_the_operator_and_the_agent(
        cluster: ClusterEmulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end in the emulator: a DOD's pod claim on gpu-0 (the test plays the
    ephemeral-volume controller and the scheduler), the operator's volume of type `Directory`,
    and gpu-0's agent making that directory, `cache/` the loader's, before a kubelet could
    mount it. The operator's node-cache root is the test's directory (kopf's CLI takes no memo)."""
    monkeypatch.setattr(handlers, "InstallationConfig",
                        lambda: InstallationConfig(node_cache_root=str(tmp_path)))
    await request(cluster, "POST", "/api/v1/nodes", {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": "gpu-0", "labels": {"kubernetes.io/hostname": "gpu-0"}}})
    operator = Operator()
    await operator.start()
    agent = KopfRunner(["run", "-A", "--standalone"], timeout=30, registry=build_registry(
        NodeAgentConfig(node="gpu-0", root=str(tmp_path), owner=LOADER)))
    await asyncio.to_thread(agent.__enter__)
    cache = tmp_path / "namespaces" / NAMESPACE / "cache"
    try:
        await request(cluster, "POST", DOD_PATH, {
            "apiVersion": "dlo.dev/v1alpha1", "kind": "DiffusionOffloadDeployment",
            "metadata": {"name": "flux", "namespace": NAMESPACE},
            "spec": {"model": {"source": "s3://models/flux/"},
                     "inference": {"image": "server:1"}}})
        sts = await eventually(lambda: live(cluster, "apps/v1/statefulsets", "flux"))
        [template] = [v["ephemeral"]["volumeClaimTemplate"]["spec"]
                      for v in sts["spec"]["template"]["spec"]["volumes"] if "ephemeral" in v]
        path = f"/api/v1/namespaces/{NAMESPACE}/persistentvolumeclaims"
        await request(cluster, "POST", path, {
            "apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": "flux-0-node-cache", "namespace": NAMESPACE,
                         "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": "flux-0",
                                              "uid": "pod-uid", "controller": True}]},
            "spec": template})
        await request(cluster, "PATCH", f"{path}/flux-0-node-cache", {
            "metadata": {"annotations": {SELECTED_NODE: "gpu-0"}}})
        await eventually(lambda: cache.is_dir() and owner_and_mode(cache))
    finally:
        await asyncio.to_thread(agent.__exit__, None, None, None)
        await operator.stop()
    assert owner_and_mode(cache) == (65532, 65532, 0o755)
    [pv] = [obj.raw for (resource, _, _), obj in list(cluster.objects.items())
            if resource == kmock.resource("v1/persistentvolumes") and not obj.deleted]
    assert pv["spec"]["hostPath"] == {"path": f"{tmp_path}/namespaces/{NAMESPACE}",
                                      "type": "Directory"}


@pytest.mark.parametrize("command", [["node-agent", "run", "--node-name=gpu-0"],
                                     ["operator", "run", "-A"], ["render", "x.yaml"]])
def test_root_as_the_loaders_user_is_refused_by_every_command(
        command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main([*command, "--node-cache-uid=0"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        "argument --node-cache-uid: '0' is not a non-root user or group id; pass a whole number "
        "from 1 to 2147483647 (the loader runs as non-root: Pod Security restricted)")
