"""The Pod Security Standards' `baseline` and `restricted` levels, checked on a pod spec as the
API server's PodSecurity admission does (Kubernetes 1.29+, policy version `latest`).

`violations(pod_spec, level)` returns one line per broken rule, named as in the standard
(https://kubernetes.io/docs/concepts/security/pod-security-standards/). `restricted` includes
`baseline`. The checks read the pod spec (and the AppArmor annotations of its metadata, passed
as `annotations`): every container, init container and ephemeral container, with the pod's
security context as the default of each container's. Used by the tests that prove every pod the
operator renders runs in a namespace labelled `pod-security.kubernetes.io/enforce: baseline`;
tests/operator/test_operator_pod_security.py checks it on known-bad pods, one per rule.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Literal

Level = Literal["baseline", "restricted"]

BASELINE_CAPABILITIES = frozenset({
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
    "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"})
SAFE_SYSCTLS = frozenset({
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes"})
SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t",
                           "container_engine_t"})
RESTRICTED_VOLUMES = frozenset({"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                                "persistentVolumeClaim", "projected", "secret"})
_APPARMOR_ANNOTATION = "container.apparmor.security.beta.kubernetes.io/"


def violations(pod_spec: Mapping[str, Any], level: Level = "baseline",
               annotations: Mapping[str, str] | None = None) -> list[str]:
    """Every rule of `level` that `pod_spec` breaks (empty: the pod is admitted)."""
    found = list(_baseline(pod_spec, annotations or {}))
    if level == "restricted":
        found += list(_restricted(pod_spec))
    return found


def containers(pod_spec: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    for key in ("initContainers", "containers", "ephemeralContainers"):
        yield from pod_spec.get(key) or ()


def _contexts(pod_spec: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """(`pod` or the container's name, its security context) for the pod and each container."""
    yield "pod", pod_spec.get("securityContext") or {}
    for container in containers(pod_spec):
        yield container.get("name", "?"), container.get("securityContext") or {}


def _baseline(pod_spec: Mapping[str, Any], annotations: Mapping[str, str]) -> Iterator[str]:
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod_spec.get(key):
            yield f"host namespaces: {key}=true"
    for volume in pod_spec.get("volumes") or ():
        if "hostPath" in volume:
            yield f"hostPath volumes: volume {volume.get('name')!r}"
    for sysctl in (pod_spec.get("securityContext") or {}).get("sysctls") or ():
        if sysctl.get("name") not in SAFE_SYSCTLS:
            yield f"sysctls: {sysctl.get('name')!r} is not a safe sysctl"
    for container in containers(pod_spec):
        yield from _baseline_container(container)
    for who, context in _contexts(pod_spec):
        yield from _baseline_context(who, context)
    for key, value in annotations.items():
        if key.startswith(_APPARMOR_ANNOTATION) and value != "runtime/default" and (
                not value.startswith("localhost/")):
            yield f"AppArmor: annotation {key}={value!r}"


def _baseline_container(container: Mapping[str, Any]) -> Iterator[str]:
    name = container.get("name", "?")
    context = container.get("securityContext") or {}
    if context.get("privileged"):
        yield f"privileged containers: {name} sets privileged=true"
    added = set((context.get("capabilities") or {}).get("add") or ()) - BASELINE_CAPABILITIES
    if added:
        yield f"capabilities: {name} adds {', '.join(sorted(added))}"
    for port in container.get("ports") or ():
        if port.get("hostPort"):
            yield f"host ports: {name} uses hostPort {port['hostPort']}"
    if context.get("procMount", "Default") != "Default":
        yield f"/proc mount type: {name} sets procMount={context['procMount']!r}"


def _baseline_context(who: str, context: Mapping[str, Any]) -> Iterator[str]:
    if (context.get("windowsOptions") or {}).get("hostProcess"):
        yield f"HostProcess: {who} sets windowsOptions.hostProcess=true"
    seccomp = (context.get("seccompProfile") or {}).get("type")
    if seccomp == "Unconfined":
        yield f"seccomp: {who} sets seccompProfile.type=Unconfined"
    apparmor = (context.get("appArmorProfile") or {}).get("type")
    if apparmor not in (None, "RuntimeDefault", "Localhost"):
        yield f"AppArmor: {who} sets appArmorProfile.type={apparmor!r}"
    selinux = context.get("seLinuxOptions") or {}
    if selinux.get("type", "") not in SELINUX_TYPES:
        yield f"SELinux: {who} sets seLinuxOptions.type={selinux['type']!r}"
    for key in ("user", "role"):
        if selinux.get(key):
            yield f"SELinux: {who} sets seLinuxOptions.{key}={selinux[key]!r}"


def _restricted(pod_spec: Mapping[str, Any]) -> Iterator[str]:
    for volume in pod_spec.get("volumes") or ():
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            yield f"volume types: volume {volume.get('name')!r} is {', '.join(sorted(kinds))}"
    pod = pod_spec.get("securityContext") or {}
    if pod.get("runAsNonRoot") is False:
        yield "running as non-root: pod sets runAsNonRoot=false"
    if pod.get("runAsUser") == 0:
        yield "running as non-root user: pod sets runAsUser=0"
    for container in containers(pod_spec):
        yield from _restricted_container(container, pod)


def _restricted_container(container: Mapping[str, Any],
                          pod: Mapping[str, Any]) -> Iterator[str]:
    name = container.get("name", "?")
    context = container.get("securityContext") or {}
    if context.get("allowPrivilegeEscalation") is not False:
        yield f"privilege escalation: {name} does not set allowPrivilegeEscalation=false"
    if context.get("runAsNonRoot", pod.get("runAsNonRoot")) is not True:
        yield f"running as non-root: {name} does not run with runAsNonRoot=true"
    if context.get("runAsUser") == 0:
        yield f"running as non-root user: {name} sets runAsUser=0"
    seccomp = (context.get("seccompProfile") or pod.get("seccompProfile") or {}).get("type")
    if seccomp not in ("RuntimeDefault", "Localhost"):
        yield f"seccomp: {name} has no RuntimeDefault or Localhost seccomp profile"
    capabilities = context.get("capabilities") or {}
    if "ALL" not in (capabilities.get("drop") or ()):
        yield f"capabilities: {name} does not drop ALL"
    added = set(capabilities.get("add") or ()) - {"NET_BIND_SERVICE"}
    if added:
        yield f"capabilities: {name} adds {', '.join(sorted(added))} (only NET_BIND_SERVICE)"
