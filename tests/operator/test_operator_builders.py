"""The pure builders: what the workload pod looks like, and `dlo render`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from dlo_contract.names import (
    DEFAULT_FILL_SECRET_FILE,
    FILL_SECRET_ENV,
    FILL_SECRET_KEY,
    FILL_SECRET_MOUNT,
)
from dlo_operator.errors import SpecError
from dlo_operator.manifests import build_children, optional_child_names, optional_children
from dlo_operator.naming import Owner, fill_secret_name, owns
from dlo_operator.prefill import build_prefill_job
from dlo_operator.render import render_file
from dlo_operator.spec import parse_spec
from dlo_cli import main as cli

OWNER = Owner(name="flux", namespace="ml", uid="uid-1")
MINIMAL = {"model": {"source": "s3://models/flux/"}, "inference": {"image": "server:1"}}
EXAMPLES = sorted(Path(__file__).parents[2].joinpath("examples").glob("*.yaml"))


def statefulset(spec: dict[str, Any], owner: Owner = OWNER) -> dict[str, Any]:
    return build_children(owner, parse_spec(spec))[3]


def revision_of(spec: dict[str, Any]) -> str:
    return str(statefulset(spec)["spec"]["template"]["metadata"]["annotations"]["dlo.dev/revision"])


def containers(sts: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    pod = sts["spec"]["template"]["spec"]
    return pod["initContainers"][0], pod["containers"][0]


def env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def mounts(container: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    """`volume` or `volume/subPath` -> (mount path, read-only)."""
    return {"/".join(filter(None, (m["name"], m.get("subPath")))): (
        m["mountPath"], m.get("readOnly", False)) for m in container["volumeMounts"]}


def test_children_are_owned_and_applied_in_dependency_order() -> None:
    children = build_children(OWNER, parse_spec(MINIMAL))
    revision = children[3]["spec"]["template"]["metadata"]["annotations"]["dlo.dev/revision"]
    assert [(c["kind"], c["metadata"]["name"]) for c in children] == [
        ("ConfigMap", f"flux-settings-{revision}"), ("ConfigMap", "flux-fill-group"),
        ("Service", "flux-peers"), ("StatefulSet", "flux"), ("NetworkPolicy", "flux"),
        ("Secret", "flux-fill-secret")]
    assert children[0]["immutable"] is True
    for child in children:
        assert child["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
        assert child["metadata"]["labels"]["dlo.dev/deployment"] == "flux"


def test_the_optional_children_are_looked_for_by_their_names_and_owner() -> None:
    everything = parse_spec({**MINIMAL, "disruptionBudget": {"enabled": True},
                             "inference": {"image": "server:1", "ports": [{"containerPort": 80}]}})
    built = optional_children(OWNER, everything)
    assert optional_child_names(OWNER) == tuple(
        (c["kind"], c["metadata"]["name"]) for c in built)
    assert [owns(OWNER, c) for c in built] == [True, True, True]
    theirs = {"metadata": {"name": "flux", "ownerReferences": [{"uid": "uid-2"}]}}
    assert [owns(OWNER, theirs), owns(OWNER, {"metadata": {"name": "flux"}}),
            owns(OWNER, None)] == [False, False, False]


def test_configmap_holds_the_normalized_settings_document() -> None:
    spec = parse_spec({**MINIMAL, "offload": {"layerwiseCpuOffload": True}})
    configmap = build_children(OWNER, spec)[0]
    document = json.loads(configmap["data"]["settings.json"])
    assert document == {**spec.settings.to_dict(),
                        "origin": f"DiffusionOffloadDeployment {OWNER.namespace}/{OWNER.name}"}
    assert document["offload"]["layerwise_cpu_offload"] is False


def test_headless_service_publishes_not_ready_pods_for_the_rendezvous() -> None:
    service = build_children(OWNER, parse_spec(MINIMAL))[2]
    assert (service["spec"]["clusterIP"], service["spec"]["publishNotReadyAddresses"]) == (
        "None", True)
    assert service["spec"]["ports"][0]["port"] == 29500


def test_statefulset_runs_one_pod_per_node_started_in_parallel() -> None:
    sts = statefulset({**MINIMAL, "replicas": 3})
    assert (sts["spec"]["replicas"], sts["spec"]["podManagementPolicy"],
            sts["spec"]["serviceName"]) == (3, "Parallel", "flux-peers")
    terms = sts["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms == [{"labelSelector": {"matchLabels": sts["spec"]["selector"]["matchLabels"]},
                      "topologyKey": "kubernetes.io/hostname"}]


def test_user_affinity_is_kept_next_to_the_anti_affinity_term() -> None:
    node_affinity = {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}]}}
    sts = statefulset({**MINIMAL, "affinity": {"nodeAffinity": node_affinity}})
    affinity = sts["spec"]["template"]["spec"]["affinity"]
    assert affinity["nodeAffinity"] == node_affinity
    assert len(affinity["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]) == 1


def test_loader_learns_its_group_from_the_fill_group_document_not_the_replicas() -> None:
    sts = statefulset({**MINIMAL, "replicas": 4, "loader": {"port": 29600}})
    loader, _ = containers(sts)
    revision = sts["spec"]["template"]["metadata"]["annotations"]["dlo.dev/revision"]
    assert loader["command"] == ["dlo", "cache", "fill"]
    assert loader["args"] == ["--config", "/etc/dlo/settings.json",
                              "--entry-file", "/run/dlo/entry.json", "--keep-running",
                              "--yield-cpu"]
    assert env(loader) == {
        "DLO_POD_NAME": {"fieldRef": {"fieldPath": "metadata.name"}},
        "DLO_REVISION": revision,
        "DLO_FILL_GROUP": {"configMapKeyRef": {"name": "flux-fill-group", "key": "group.json",
                                               "optional": True}},
        "DLO_CONFIG": "/etc/dlo/settings.json",
        "DLO_FILL_SECRET_FILE": "/run/dlo-fill-secret/secret",
        "DLO_NODE_NAME": {"fieldRef": {"fieldPath": "spec.nodeName"}},
    }
    scaled = statefulset({**MINIMAL, "replicas": 9, "loader": {"port": 29600}})
    assert scaled["spec"]["template"] == sts["spec"]["template"]
    group = json.loads(build_children(OWNER, parse_spec({**MINIMAL, "replicas": 2}))[1]["data"][
        "group.json"])
    assert group == {"revision": revision_of(MINIMAL), "members": {"flux-0": 0, "flux-1": 1},
                     "masterAddr": "flux-0.flux-peers.ml.svc",
                     "masterPort": 29500}
    assert mounts(loader) == {"settings": ("/etc/dlo", True), "run": ("/run/dlo", False),
                              "loader-tmp": ("/tmp", False),
                              "node-cache/cache": ("/var/lib/dlo/cache", False),
                              "fill-secret": ("/run/dlo-fill-secret", True)}


def test_the_workload_loader_is_a_native_sidecar_and_the_prefill_loader_is_not() -> None:
    """The server starts while its pod's loader fills: the loader is an init container with
    `restartPolicy: Always` that stays up after publishing, ready once the entry document exists;
    the inference container waits for that document up to the fill's deadline."""
    spec = {**MINIMAL, "loader": {"timeoutSeconds": 900.5}}
    loader, inference = containers(statefulset(spec))
    assert loader["restartPolicy"] == "Always"
    assert loader["args"][-2:] == ["--keep-running", "--yield-cpu"]
    assert loader["readinessProbe"]["exec"]["command"] == ["test", "-s", "/run/dlo/entry.json"]
    assert "startupProbe" not in loader  # it would hold the inference container back
    assert env(inference)["DLO_ENTRY_WAIT_SECONDS"] == "900.5"
    job = build_prefill_job(OWNER, parse_spec(spec), ["node-a", "node-b"])
    prefill_loader = job["spec"]["template"]["spec"]["containers"][0]
    assert "restartPolicy" not in prefill_loader and "readinessProbe" not in prefill_loader
    assert not {"--keep-running", "--yield-cpu"} & set(prefill_loader["args"])


def test_the_fill_secret_is_mounted_read_only_in_the_loaders_only() -> None:
    """Issue 43: the DOD's fill Secret keys its fill group, so only its loaders (the workload
    pods' sidecar and the prefill Job's loaders) mount it, read-only, and find it through
    DLO_FILL_SECRET_FILE; the inference container (the user's code) neither mounts it nor is
    told where it is. Rendered without data: the operator writes the bytes, once."""
    spec = parse_spec({**MINIMAL, "inference": {"image": "server:1", "volumeMounts": []}})
    workload = statefulset(MINIMAL)["spec"]["template"]["spec"]
    prefill = build_prefill_job(OWNER, spec, ["a", "b"])["spec"]["template"]["spec"]
    volume = {"name": "fill-secret", "secret": {
        "secretName": "flux-fill-secret", "defaultMode": 0o444,
        "items": [{"key": FILL_SECRET_KEY, "path": FILL_SECRET_KEY}]}}
    for pod in (workload, prefill):
        assert [v for v in pod["volumes"] if "secret" in v] == [volume]
        loaders = [c for c in pod.get("initContainers", []) + pod["containers"]
                   if c["name"] == "loader"]
        assert len(loaders) == 1
        for container in pod.get("initContainers", []) + pod["containers"]:
            mounted = [m for m in container["volumeMounts"] if m["name"] == "fill-secret"]
            told = env(container).get(FILL_SECRET_ENV)
            if container["name"] == "loader":
                assert mounted == [{"name": "fill-secret", "mountPath": FILL_SECRET_MOUNT,
                                    "readOnly": True}]
                assert told == DEFAULT_FILL_SECRET_FILE == f"{FILL_SECRET_MOUNT}/secret"
            else:
                assert (container["name"], mounted, told) == ("inference", [], None)
    secret = build_children(OWNER, spec)[-1]
    assert (secret["kind"], secret["metadata"]["name"]) == ("Secret", fill_secret_name("flux"))
    assert "data" not in secret and "stringData" not in secret
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-1"


def test_loader_is_locked_down() -> None:
    loader, _ = containers(statefulset(MINIMAL))
    assert loader["securityContext"] == {
        "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
        "privileged": False, "readOnlyRootFilesystem": True,
        "runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532,
        "seccompProfile": {"type": "RuntimeDefault"}}
    pod = statefulset(MINIMAL)["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert "serviceAccountName" not in pod


def test_s3_keys_come_from_the_secret_reference() -> None:
    loader, inference = containers(statefulset({**MINIMAL, "model": {
        "source": "s3://b/p/", "credentials": {"secretName": "keys", "accessKeyIdKey": "id"}}}))
    assert env(loader)["AWS_ACCESS_KEY_ID"] == {
        "secretKeyRef": {"name": "keys", "key": "id", "optional": False}}
    assert env(loader)["AWS_SESSION_TOKEN"] == {
        "secretKeyRef": {"name": "keys", "key": "AWS_SESSION_TOKEN", "optional": True}}
    assert not {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} & set(env(inference))


def test_service_account_for_web_identity_is_passed_through() -> None:
    pod = statefulset({**MINIMAL, "serviceAccountName": "reader",
                       "automountServiceAccountToken": True})["spec"]["template"]["spec"]
    assert (pod["serviceAccountName"], pod["automountServiceAccountToken"]) == ("reader", True)


def test_inference_container_gets_contract_c3_and_a_read_only_cache() -> None:
    _, inference = containers(statefulset({**MINIMAL, "gpusPerPod": 8, "inference": {
        "image": "server:1", "env": [{"name": "A", "value": "1"}],
        "resources": {"limits": {"memory": "10Gi"}}}}))
    assert env(inference) == {"A": "1", "DLO_CONFIG": "/etc/dlo/settings.json",
                              "DLO_ENTRY_FILE": "/run/dlo/entry.json",
                              "DLO_ENTRY_WAIT_SECONDS": "3600"}
    assert mounts(inference) == {"settings": ("/etc/dlo", True), "run": ("/run/dlo", True),
                                 "node-cache/cache": ("/var/lib/dlo/cache", True),
                                 "dshm": ("/dev/shm", False)}
    assert inference["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert inference["resources"] == {"limits": {"memory": "10Gi", "nvidia.com/gpu": "8"}}


def test_the_runtime_cache_writes_its_own_dods_directory_and_the_entries_stay_read_only() -> None:
    """Attack 5 of issue 33: with the runtime cache on, the inference container mounted the
    whole cache root writable. Now the entries are read-only and the runtime cache is the DOD's
    own directory of its namespace's claim (`runtime/<dod>`), beside the entries."""
    runtime = {"useAllgather": False, "enableRuntimeCache": True}
    for offload, path in (({**runtime, "runtimeCacheRoot": "/mnt/rt"}, "/mnt/rt"),
                          (runtime, "/var/lib/dlo/runtime")):
        sts = statefulset({**MINIMAL, "offload": offload})
        loader, inference = containers(sts)
        assert {k: v for k, v in mounts(inference).items() if k.startswith("node-cache")} == {
            "node-cache/cache": ("/var/lib/dlo/cache", True),
            "node-cache/runtime/flux": (path, False)}
        assert [k for k in mounts(loader) if k.startswith("node-cache")] == ["node-cache/cache"]
        settings = json.loads(build_children(OWNER, parse_spec({**MINIMAL, "offload": offload}))[
            0]["data"]["settings.json"])
        assert settings["offload"]["runtime_cache_root"] == path
        volumes = sts["spec"]["template"]["spec"]["volumes"]
        assert [v["name"] for v in volumes if "ephemeral" in v] == ["node-cache"]
        assert not [v for v in volumes if "hostPath" in v]
    other = containers(statefulset({**MINIMAL, "offload": runtime}, Owner(name="wan",
                                                                          namespace="ml")))[1]
    assert mounts(other)["node-cache/runtime/wan"] == ("/var/lib/dlo/runtime", False)


def test_no_pod_mounts_a_node_directory_and_the_cache_is_the_pods_own_claim() -> None:
    """Attack 4 of issue 33: every pod mounted the node's whole cache root. Now the workload and
    prefill pods hold one claim each of the operator's node-cache class, which serves only the
    pod's namespace's directory (tests/operator/test_operator_node_cache.py)."""
    spec = parse_spec(MINIMAL)
    workload = build_children(OWNER, spec)[3]["spec"]["template"]["spec"]
    prefill = build_prefill_job(OWNER, spec, ["a", "b"])["spec"]["template"]["spec"]
    for pod in (workload, prefill):
        [cache] = [v for v in pod["volumes"] if v["name"] == "node-cache"]
        assert cache == {"name": "node-cache", "ephemeral": {"volumeClaimTemplate": {"spec": {
            "accessModes": ["ReadWriteOncePod"], "storageClassName": "dlo-node-cache",
            "resources": {"requests": {"storage": "1Gi"}}}}}}
        assert "hostPath" not in json.dumps(pod)


def test_a_settings_change_changes_the_pod_template() -> None:
    def template_hash(spec: dict[str, Any]) -> str:
        return statefulset(spec)["spec"]["template"]["metadata"]["annotations"][
            "dlo.dev/settings-sha256"]
    assert template_hash(MINIMAL) == template_hash(dict(MINIMAL))
    assert template_hash(MINIMAL) != template_hash({**MINIMAL, "quantization": "fp8_per_tensor"})


def test_render_prints_the_children_of_every_example(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["render", str(EXAMPLES[0])]) == 0
    documents = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [d["kind"] for d in documents] == ["ConfigMap", "ConfigMap", "Service", "StatefulSet",
                                              "Service", "PodDisruptionBudget", "NetworkPolicy",
                                              "Secret"]
    assert "data" not in documents[-1]  # the operator writes it, once, at creation
    assert all("ownerReferences" not in d["metadata"] for d in documents)
    for example in EXAMPLES:
        kinds = [d["kind"] for d in yaml.safe_load_all(render_file(example))]
        assert kinds[:4] == ["ConfigMap", "ConfigMap", "Service", "StatefulSet"], example.name


def test_render_reports_an_invalid_spec_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "dlo.dev/v1alpha1",
                                    "kind": "DiffusionOffloadDeployment",
                                    "metadata": {"name": "bad"},
                                    "spec": {**MINIMAL, "parallel": {"hsdp": True, "dp": 2},
                                             "offload": {"useAllgather": False}}}))
    assert cli.main(["render", str(path)]) == 1
    assert capsys.readouterr().err == (
        "dlo: error: default/bad: spec.parallel.hsdp: [hsdp-with-dp-or-tp] HSDP cannot combine "
        "with spec.parallel.dp > 1 or spec.parallel.tp > 1; fix: set spec.parallel.dp=1 and "
        "spec.parallel.tp=1, or spec.parallel.hsdp=false "
        "(hint: fix the fields named; `kubectl explain diffusionoffloaddeployment.spec` "
        "describes each)\n")


def test_render_rejects_other_kinds(tmp_path: Path) -> None:
    path = tmp_path / "pod.yaml"
    path.write_text("apiVersion: v1\nkind: Pod\nmetadata: {name: p}\n")
    with pytest.raises(SpecError, match="^expected apiVersion dlo.dev/v1alpha1 kind "
                                        "DiffusionOffloadDeployment, found 'Pod'$"):
        render_file(path)
