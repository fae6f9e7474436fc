"""Pod Security: the checker (tests/support/pod_security.py) refuses a known-bad pod for each
rule, so that a pass elsewhere is not luck; every pod the operator renders passes `baseline`,
and every loader container `restricted`, as the platform's non-root user (README "Pod
Security")."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from dlo_operator.admission import admit
from dlo_operator.installation import InstallationConfig
from dlo_operator.manifests import build_children
from dlo_operator.naming import Owner
from dlo_operator.prefill import build_prefill_job
from dlo_operator.spec import parse_spec
from support.pod_security import containers, violations

RESTRICTED_POD: dict[str, Any] = {
    "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
    "containers": [{"name": "app", "image": "a:1", "securityContext": {
        "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}],
    "volumes": [{"name": "c", "ephemeral": {"volumeClaimTemplate": {"spec": {}}}},
                {"name": "e", "emptyDir": {}}],
}


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """A change of `RESTRICTED_POD` at `path` (`containers.0.securityContext.privileged`)."""
    def change(pod: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        target: Any = pod
        for part in parents:
            target = target[int(part)] if part.isdigit() else target.setdefault(part, {})
        target[int(last) if last.isdigit() else last] = value
    return change


CONTAINER = "containers.0.securityContext"
BASELINE_BREAKS = [
    (_set("hostNetwork", True), "host namespaces: hostNetwork=true"),
    (_set("hostPID", True), "host namespaces: hostPID=true"),
    (_set("hostIPC", True), "host namespaces: hostIPC=true"),
    (_set("volumes.1", {"name": "h", "hostPath": {"path": "/"}}),
     "hostPath volumes: volume 'h'"),
    (_set(f"{CONTAINER}.privileged", True), "privileged containers: app sets privileged=true"),
    (_set(f"{CONTAINER}.capabilities.add", ["SYS_ADMIN"]), "capabilities: app adds SYS_ADMIN"),
    (_set("containers.0.ports", [{"containerPort": 80, "hostPort": 80}]),
     "host ports: app uses hostPort 80"),
    (_set("securityContext.sysctls", [{"name": "kernel.msgmax", "value": "1"}]),
     "sysctls: 'kernel.msgmax' is not a safe sysctl"),
    (_set(f"{CONTAINER}.seccompProfile", {"type": "Unconfined"}),
     "seccomp: app sets seccompProfile.type=Unconfined"),
    (_set(f"{CONTAINER}.procMount", "Unmasked"),
     "/proc mount type: app sets procMount='Unmasked'"),
    (_set(f"{CONTAINER}.appArmorProfile", {"type": "Unconfined"}),
     "AppArmor: app sets appArmorProfile.type='Unconfined'"),
    (_set("securityContext.seLinuxOptions", {"type": "spc_t"}),
     "SELinux: pod sets seLinuxOptions.type='spc_t'"),
    (_set(f"{CONTAINER}.seLinuxOptions", {"user": "system_u"}),
     "SELinux: app sets seLinuxOptions.user='system_u'"),
    (_set(f"{CONTAINER}.windowsOptions", {"hostProcess": True}),
     "HostProcess: app sets windowsOptions.hostProcess=true"),
]
RESTRICTED_BREAKS = [
    (_set("volumes.1", {"name": "n", "nfs": {"server": "s", "path": "/"}}),
     "volume types: volume 'n' is nfs"),
    (_set(f"{CONTAINER}.allowPrivilegeEscalation", True),
     "privilege escalation: app does not set allowPrivilegeEscalation=false"),
    (_set("securityContext.runAsNonRoot", None),
     "running as non-root: app does not run with runAsNonRoot=true"),
    (_set(f"{CONTAINER}.runAsUser", 0), "running as non-root user: app sets runAsUser=0"),
    (_set("securityContext.seccompProfile", None),
     "seccomp: app has no RuntimeDefault or Localhost seccomp profile"),
    (_set(f"{CONTAINER}.capabilities", {"drop": ["NET_RAW"]}),
     "capabilities: app does not drop ALL"),
    (_set(f"{CONTAINER}.capabilities.add", ["CHOWN"]),
     "capabilities: app adds CHOWN (only NET_BIND_SERVICE)"),
]


def test_the_known_good_pod_passes_both_levels() -> None:
    assert violations(RESTRICTED_POD, "restricted") == []


def _ids(breaks: list[tuple[Any, str]]) -> list[str]:
    return [expected.split(":")[0] + f"-{i}" for i, (_, expected) in enumerate(breaks)]


def _broken(change: Any) -> dict[str, Any]:
    """A copy of the known good pod with `change` applied."""
    pod = copy.deepcopy(RESTRICTED_POD)
    change(pod)
    return pod


@pytest.mark.parametrize(("change", "expected"), BASELINE_BREAKS, ids=_ids(BASELINE_BREAKS))
def test_each_baseline_rule_refuses_its_known_bad_pod(change: Any, expected: str) -> None:
    pod = _broken(change)
    assert violations(pod, "baseline") == [expected]
    assert expected in violations(pod, "restricted")


@pytest.mark.parametrize(("change", "expected"), RESTRICTED_BREAKS, ids=_ids(RESTRICTED_BREAKS))
def test_each_restricted_rule_refuses_its_known_bad_pod(change: Any, expected: str) -> None:
    pod = _broken(change)
    assert violations(pod, "restricted") == [expected]
    assert violations(pod, "baseline") == []


def test_an_apparmor_annotation_other_than_the_runtimes_is_refused() -> None:
    key = "container.apparmor.security.beta.kubernetes.io/app"
    assert violations(RESTRICTED_POD, annotations={key: "unconfined"}) == [
        f"AppArmor: annotation {key}='unconfined'"]
    assert violations(RESTRICTED_POD, annotations={key: "localhost/mine"}) == []


def test_every_rendered_loader_passes_restricted_as_the_platforms_user() -> None:
    """A prefill pod holds only the loader: the whole pod passes `restricted`. In a workload pod
    the loader container does (the inference container is the user's, `baseline`). The loader
    runs as the installation's non-root user, who owns the namespace's `cache/` (the node
    agent made it so), never as root."""
    spec = admit({"metadata": {"name": "flux", "namespace": "ml"},
                  "spec": {"model": {"source": "s3://m/p/"}, "inference": {"image": "s:1"}}},
                 InstallationConfig(node_cache_uid=1000, node_cache_gid=2000))
    owner = Owner(name="flux", namespace="ml")
    job = build_prefill_job(owner, spec, ["a", "b"])["spec"]["template"]["spec"]
    assert violations(job, "restricted") == []
    workload = build_children(owner, spec)[3]["spec"]["template"]["spec"]
    assert violations(workload, "baseline") == []
    loader_only = {**workload, "containers": []}
    assert violations(loader_only, "restricted") == []
    for pod in (job, workload):
        [loader] = [c for c in containers(pod) if c["name"] == "loader"]
        assert {key: loader["securityContext"][key] for key in (
            "runAsNonRoot", "runAsUser", "runAsGroup")} == {
            "runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 2000}


def test_the_loader_runs_as_the_loader_images_user_by_default() -> None:
    spec = parse_spec({"model": {"source": "s3://m/p/"}, "inference": {"image": "s:1"}})
    job = build_prefill_job(Owner(name="flux", namespace="ml"), spec, ["a"])
    context = job["spec"]["template"]["spec"]["containers"][0]["securityContext"]
    assert (context["runAsUser"], context["runAsGroup"]) == (65532, 65532)
    assert violations(job["spec"]["template"]["spec"], "restricted") == []
