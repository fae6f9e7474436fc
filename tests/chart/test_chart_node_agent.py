"""The chart's node agent (templates/node-agent-*.yaml), rendered by the real Helm engine: a
DaemonSet in the release's namespace with the least privilege that prepares the node-cache
directories needs (the hostPath of nodeCache.hostPath alone, uid 0 with CHOWN alone, read-only
root filesystem), its own ServiceAccount that may only read PersistentVolumes, and a command
line `dlo node-agent run` accepts with the same owner the operator runs the loader as."""

from __future__ import annotations

import argparse
from typing import Any

import kubernetes_validate
import pytest

from dlo_operator import node_agent
from support.pod_security import violations
from chart.test_chart import KUBERNETES_VERSIONS, NON_DEFAULT, by_kind, render


def agent(values: dict[str, Any] | None = None) -> dict[str, Any]:
    [daemonset] = by_kind(render(values))["DaemonSet"]
    return daemonset


def test_the_agent_has_the_hostpath_of_the_node_cache_and_chown_alone() -> None:
    daemonset = agent(NON_DEFAULT)
    assert (daemonset["metadata"]["name"], daemonset["metadata"]["namespace"]) == (
        "dlo-dlo-operator-node-agent", "dlo-system")
    pod = daemonset["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["securityContext"] == {
        "runAsUser": 0, "runAsGroup": 0, "runAsNonRoot": False,
        "allowPrivilegeEscalation": False, "privileged": False,
        "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"], "add": ["CHOWN"]}}
    assert [v for v in pod["volumes"] if "hostPath" in v] == [
        {"name": "node-cache", "hostPath": {"path": "/mnt/nvme/dlo", "type": "DirectoryOrCreate"}}]
    assert {m["name"]: m["mountPath"] for m in container["volumeMounts"]} == {
        "node-cache": "/mnt/nvme/dlo", "tmp": "/tmp"}
    # Its one gap to baseline, why the operator's namespace (never a tenant's) is privileged.
    assert violations(pod, "baseline") == ["hostPath volumes: volume 'node-cache'"]
    assert (pod["nodeSelector"], pod["tolerations"], pod["priorityClassName"]) == (
        {"nvidia.com/gpu.present": "true"}, NON_DEFAULT["nodeAgent"]["tolerations"],
        "system-node-critical")
    assert pod["serviceAccountName"] == "dlo-dlo-operator-node-agent"


def test_the_agent_may_only_read_persistent_volumes() -> None:
    kinds = by_kind(render())
    [role] = [r for r in kinds["ClusterRole"] if r["metadata"]["name"].endswith("-node-agent")]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["persistentvolumes"],
                              "verbs": ["get", "list", "watch"]}]
    [binding] = [b for b in kinds["ClusterRoleBinding"]
                 if b["roleRef"]["name"] == role["metadata"]["name"]]
    assert binding["subjects"] == [{"kind": "ServiceAccount",
                                    "name": "dlo-dlo-operator-node-agent",
                                    "namespace": "dlo-system"}]
    assert not any(b["subjects"][0]["name"] == "dlo-dlo-operator-node-agent"
                   for b in kinds["ClusterRoleBinding"] if b is not binding)


@pytest.mark.parametrize("values", [None, NON_DEFAULT], ids=["defaults", "non-default"])
def test_the_agents_command_line_is_accepted_and_agrees_with_the_operator(
        values: dict[str, Any] | None) -> None:
    kinds = by_kind(render(values))
    args = [a for a in kinds["DaemonSet"][0]["spec"]["template"]["spec"]["containers"][0]["args"]
            if a != "--debug"]
    assert args[:2] == ["node-agent", "run"]
    parser = argparse.ArgumentParser()
    node_agent.add_arguments(parser)
    parsed = parser.parse_args(args[2:])
    operator_args = kinds["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert parsed.node_name == "$(NODE_NAME)"  # the downward API's spec.nodeName
    for flag, value in (("--node-cache-root", parsed.node_cache_root),
                        ("--node-cache-uid", parsed.node_cache_uid),
                        ("--node-cache-gid", parsed.node_cache_gid)):
        assert f"{flag}={value}" in operator_args
    assert parsed.namespace_quota_bytes == 0


def test_a_namespace_quota_is_passed_with_sys_admin_and_only_then() -> None:
    """Issue 43: `nodeCache.maxBytes` binds only the loader; the filesystem's project quota
    binds every file a namespace's pods write. quotactl needs CAP_SYS_ADMIN, added with it."""
    [container] = agent({"nodeCache": {"namespaceQuotaBytes": 500 * 2**30}})[
        "spec"]["template"]["spec"]["containers"]
    assert "--namespace-quota-bytes=536870912000" in container["args"]
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"],
                                                            "add": ["CHOWN", "SYS_ADMIN"]}
    for version in KUBERNETES_VERSIONS:
        assert kubernetes_validate.validate(
            agent({"nodeCache": {"namespaceQuotaBytes": 1}}), version, strict=True) == version


def test_the_rendered_daemonset_is_valid_for_every_version() -> None:
    for values in (None, NON_DEFAULT):
        for version in KUBERNETES_VERSIONS:
            assert kubernetes_validate.validate(agent(values), version, strict=True) == version


def test_turning_the_agent_off_renders_none_of_it() -> None:
    kinds = by_kind(render({"nodeAgent": {"enabled": False}}))
    assert "DaemonSet" not in kinds
    assert not [r for r in kinds["ClusterRole"] if r["metadata"]["name"].endswith("-node-agent")]
    assert [a["metadata"]["name"] for a in kinds["ServiceAccount"]] == ["dlo-dlo-operator"]
