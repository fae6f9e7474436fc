"""Pod states that mean trouble, named as Kubernetes names them, with the pod and the node.

`pod_troubles(pods)` reads each pod's scheduling condition and container statuses and returns
one `Trouble` per pod in trouble, most telling first (a pod the API server refused to create,
`FailedCreate`, is `pod_refusals`'): `Unschedulable` (the scheduler's message),
`ImagePullBackOff`, `OOMKilled`, `CrashLoopBackOff` of the inference container, and
`LoaderFailed` (the loader's own one-line error, from its summary or its log tail). The pods are
workload pods (the loader a sidecar) or prefill Job pods (the loader their one container). Pure;
called by `status` and `prefill_stage`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dlo_operator.naming import INFERENCE_CONTAINER, LOADER_CONTAINER


class TroubleReason(str, enum.Enum):
    FAILED_CREATE = "FailedCreate"
    """The API server refused to create the pod (`pod_refusals`): it does not exist."""
    UNSCHEDULABLE = "Unschedulable"
    IMAGE_PULL_BACK_OFF = "ImagePullBackOff"
    OOM_KILLED = "OOMKilled"
    CRASH_LOOP_BACK_OFF = "CrashLoopBackOff"
    CONTAINER_CONFIG_ERROR = "CreateContainerConfigError"
    LOADER_FAILED = "LoaderFailed"
    NO_PROGRESS = "NoProgress"
    """A prefill loader that runs but shows no progress (`prefill_watch`)."""


NOT_STARTING = frozenset({TroubleReason.FAILED_CREATE, TroubleReason.UNSCHEDULABLE,
                          TroubleReason.IMAGE_PULL_BACK_OFF,
                          TroubleReason.CONTAINER_CONFIG_ERROR})
"""Troubles that keep a container from starting at all: they last until someone acts (a
container that ran and failed has an end, which its pod or its Job reports)."""
_IMAGE_PULL = frozenset({"ImagePullBackOff", "ErrImagePull", "InvalidImageName"})
_CONFIG = frozenset({"CreateContainerConfigError", "CreateContainerError", "RunContainerError"})


@dataclass(frozen=True)
class Trouble:
    reason: TroubleReason
    pod: str
    node: str
    container: str
    detail: str

    @property
    def message(self) -> str:
        state = "not created" if self.reason is TroubleReason.FAILED_CREATE else "not scheduled"
        where = f"pod {self.pod} on node {self.node}" if self.node else (
            f"pod {self.pod} ({state})" if self.pod else f"a pod ({state})")
        what = f"{self.container} container of {where}" if self.container else where
        return f"{what}: {self.reason.value}: {self.detail or 'no message'}"


def pod_troubles(pods: Sequence[Mapping[str, Any]],
                 loader_errors: Mapping[str, str]) -> list[Trouble]:
    """`loader_errors` maps a pod name to its failed loader's message (see `status`)."""
    found = [t for pod in pods if (t := _trouble(pod, loader_errors)) is not None]
    order = list(TroubleReason)
    return sorted(found, key=lambda t: (order.index(t.reason), t.pod))


def _trouble(pod: Mapping[str, Any], loader_errors: Mapping[str, str]) -> Trouble | None:
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    name = str(meta.get("name", ""))
    node = str((pod.get("spec") or {}).get("nodeName") or "")
    for condition in status.get("conditions") or ():
        if (condition.get("type"), condition.get("status"), condition.get("reason")) == (
                "PodScheduled", "False", "Unschedulable"):
            return Trouble(TroubleReason.UNSCHEDULABLE, name, "", "",
                           str(condition.get("message") or ""))
    for statuses, container in (("initContainerStatuses", LOADER_CONTAINER),
                                ("containerStatuses", LOADER_CONTAINER),  # a prefill Job's
                                ("containerStatuses", INFERENCE_CONTAINER)):
        found = _container_trouble(_find(status.get(statuses), container))
        if found is not None:
            reason, detail = found
            if container == INFERENCE_CONTAINER and reason is TroubleReason.LOADER_FAILED:
                continue  # an exit the kubelet restarts; CrashLoopBackOff reports a loop
            if container == LOADER_CONTAINER and reason is TroubleReason.CRASH_LOOP_BACK_OFF:
                reason = TroubleReason.LOADER_FAILED
            if reason is TroubleReason.LOADER_FAILED:
                detail = loader_errors.get(name) or detail
            return Trouble(reason, name, node, container, detail)
    return None


def _container_trouble(container: Mapping[str, Any] | None) -> tuple[TroubleReason, str] | None:
    if not container:
        return None
    state = container.get("state") or {}
    last = (container.get("lastState") or {}).get("terminated") or {}
    terminated = state.get("terminated") or {}
    waiting = state.get("waiting") or {}
    if "OOMKilled" in (terminated.get("reason"), last.get("reason")):
        limit = "the container's memory limit"
        return TroubleReason.OOM_KILLED, f"killed for exceeding {limit}; raise it"
    reason = waiting.get("reason")
    detail = str(waiting.get("message") or _last_line(last.get("message")))
    for reasons, trouble in ((_IMAGE_PULL, TroubleReason.IMAGE_PULL_BACK_OFF),
                             (_CONFIG, TroubleReason.CONTAINER_CONFIG_ERROR)):
        if reason in reasons:
            return trouble, detail if reason == trouble.value else f"{reason}: {detail}"
    if reason == "CrashLoopBackOff":
        return TroubleReason.CRASH_LOOP_BACK_OFF, detail or (
            f"exit code {last.get('exitCode')}" if last else "")
    if terminated and terminated.get("exitCode") not in (None, 0):
        return TroubleReason.LOADER_FAILED, _last_line(terminated.get("message"))
    return None


def _find(statuses: Any, name: str) -> Mapping[str, Any] | None:
    for status in statuses or ():
        if status.get("name") == name:
            return status
    return None


def _last_line(message: Any) -> str:
    lines = [line.strip() for line in str(message or "").splitlines() if line.strip()]
    return lines[-1][:512] if lines else ""
