"""`status_from_pods`: the DOD status (phase, conditions, per-node cache state) from its pods.

Reads each workload pod's loader (a native sidecar: running and ready once it published; the
prefill Job's loader ends): its state (waiting, running, ready, terminated, crash-looping) and its
termination message, the one-line JSON summary of contract C2 (for a sidecar that published, the
copy the operator keeps on the pod, `naming.ANNOTATION_FILL_SUMMARY`). Pure: the
handlers pass the pods (from kopf's in-memory index), the previous status (to keep condition
transition times) and the clock. It must not call the cluster or read the settings document.

Phases, first match wins:
    Failed     the spec is refused (`Valid=False`) or the API refused a child (`Applied=False`)
    Pending    an API error is being retried, a pod is Unschedulable, or the API server refused
               to create one (`FailedCreate`, its StatefulSet's Event: Pod Security, a quota)
    Degraded   a pod is in trouble (`pod_troubles`: a loader failing, ImagePullBackOff,
               OOMKilled, a crash-looping inference container)
    Updating   a pod of an older revision is left: a rollout to the spec's revision runs while
               the old pods serve (`reconcile` names its stage in the reason)
    Ready      every replica's pod is Ready at the spec's revision
    Loading    a loader or an inference server has started
    Pending    no loader has started yet
The `Ready` condition carries the reason and message of the phase, so `kubectl wait
--for=condition=Ready dod/NAME` returns once the spec's revision serves on every replica and
says why not until then; `Available` says whether every replica serves, whatever its revision.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any

from dlo_contract.documents import DocumentError, FillSummary
from dlo_operator.conditions import FALSE, TRUE, Condition, merge_conditions
from dlo_operator.fill_report import figures
from dlo_operator.loader_image import live_image
from dlo_operator.naming import (
    ANNOTATION_FILL_SUMMARY,
    ANNOTATION_REVISION,
    LABEL_JOB_INDEX,
    LABEL_POD_INDEX,
    LOADER_CONTAINER,
)
from dlo_operator.pod_troubles import Trouble, TroubleReason, pod_troubles

VALID = "Valid"
APPLIED = "Applied"
READY = "Ready"
APPLY_RETRYING = "ApplyRetrying"
"""The `Applied` reason of an API error that is retried (the others are permanent)."""
TROUBLE_REASONS = frozenset(reason.value for reason in TroubleReason)
"""Reasons of the `Ready` condition that mean a pod is in trouble (a Warning Event each)."""
PREFILLED = "Prefilled"
PROGRESSING = "Progressing"
UPDATING = "Updating"
"""The phase of a rollout: pods of an older revision serve while the spec's arrives."""
ROLLING_UPDATE = "RollingUpdate"
"""The reason of `Ready` and `Progressing` while the StatefulSet replaces outdated pods."""
CONDITION_TYPES = (VALID, APPLIED, "CacheReady", "Available", PROGRESSING, READY, PREFILLED)
"""Every condition type the operator writes (`Prefilled` comes from the rollout, in `reconcile`)."""
_FAILING_WAIT_REASONS = frozenset({
    "CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "InvalidImageName",
    "CreateContainerConfigError", "CreateContainerError", "RunContainerError",
})
_MESSAGE_LIMIT = 512
_WAITING = frozenset({TroubleReason.FAILED_CREATE, TroubleReason.UNSCHEDULABLE})
"""Troubles of a pod that does not run yet: the DOD is Pending until someone acts."""


class LoaderState(str, enum.Enum):
    """Where one node's loader is; `Cached` means the node holds the entry."""

    WAITING = "Waiting"
    RUNNING = "Running"
    CACHED = "Cached"
    FAILED = "Failed"


def node_entry(pod: Mapping[str, Any]) -> dict[str, Any]:
    """One pod's row: node, rank, loader state and the loader's summary figures."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    loader = _container_status(status.get("initContainerStatuses"), LOADER_CONTAINER)
    state, message, summary = _loader_state(loader, sidecar=True)
    if state is LoaderState.CACHED and summary is None:  # a sidecar that published stays up
        summary = _summary((meta.get("annotations") or {}).get(ANNOTATION_FILL_SUMMARY))
    entry: dict[str, Any] = {
        "pod": meta.get("name", ""),
        "node": (pod.get("spec") or {}).get("nodeName", ""),
        "rank": _rank(meta),
        "loader": state.value,
        "restarts": int((loader or {}).get("restartCount", 0)),
        "ready": _pod_ready(pod),
    }
    if message:
        entry["message"] = message
    entry.update(figures(summary))
    return entry


def prefill_node(pod: Mapping[str, Any]) -> dict[str, Any]:
    """One prefill Job pod's row: node, rank, loader state and the loader's summary figures."""
    meta = pod.get("metadata") or {}
    loader = _container_status((pod.get("status") or {}).get("containerStatuses"),
                               LOADER_CONTAINER)
    state, message, summary = _loader_state(loader, sidecar=False)
    index = (meta.get("labels") or {}).get(LABEL_JOB_INDEX, "")
    row: dict[str, Any] = {
        "pod": meta.get("name", ""), "node": (pod.get("spec") or {}).get("nodeName", ""),
        "rank": int(index) if str(index).isdigit() else -1, "loader": state.value,
    }
    if message:
        row["message"] = message
    row.update(figures(summary))
    return row


def status_from_pods(
    pods: Sequence[Mapping[str, Any]],
    *,
    replicas: int,
    previous: Mapping[str, Any] | None,
    now: str,
    generation: int | None = None,
    problems: Sequence[Condition] = (),
    revision: str | None = None,
    refused: Sequence[Trouble] = (),
    loader_image: str | None = None,
) -> dict[str, Any]:
    """The status fields this operator owns. `problems` are failed conditions found outside the
    pods (`Valid` for a refused spec, `Applied` for a refused or retried apply); they decide the
    phase before the pods do. `revision` is the spec's: a pod whose revision annotation differs
    is outdated (None, for a refused spec, counts every pod as current), and so is one whose
    loader image is not `loader_image` (`loader_image`: the pods roll onto a new one).
    `refused`: pods the API server refused to create (`pod_refusals`), troubles that no pod
    shows."""
    live = [p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")]
    nodes = sorted((node_entry(p) for p in live), key=lambda n: (n["rank"], n["pod"]))
    ready = sum(1 for n in nodes if n["ready"])
    cached = sum(1 for n in nodes if n["loader"] == LoaderState.CACHED.value)
    current = [p for p in live if revision is None or _revision(p) == revision]
    updated = sum(1 for p in current
                  if loader_image is None or live_image(p) in (None, loader_image))
    loader_errors = {n["pod"]: n["message"] for n in nodes
                     if n["loader"] == LoaderState.FAILED.value and n.get("message")}
    troubles = [*refused, *pod_troubles(live, loader_errors)]
    if problems or troubles or updated == len(live):
        phase, reason, message = _phase(nodes, ready, cached, replicas, troubles, problems)
    else:  # pods of an older revision are left: a rollout runs while they serve
        target = (f"revision {revision}" if len(current) < len(live)
                  else f"loader image {loader_image}")
        phase, reason, message = UPDATING, ROLLING_UPDATE, (
            f"rolling update to {target}: {updated}/{replicas} pods updated, "
            f"{ready}/{replicas} replicas ready")
    conditions = _conditions(phase, reason, message, ready, cached, replicas, troubles, problems)
    return {
        "phase": phase,
        "message": message,
        "replicas": replicas,
        "readyReplicas": ready,
        "updatedReplicas": updated,
        "cachedReplicas": cached,
        "ready": f"{ready}/{replicas}",
        "cache": f"{cached}/{replicas}",
        "nodes": nodes,
        "conditions": merge_conditions((previous or {}).get("conditions"), conditions,
                                       generation=generation, now=now),
    }


def _phase(nodes: list[dict[str, Any]], ready: int, cached: int, replicas: int,
           troubles: list[Trouble], problems: Sequence[Condition]) -> tuple[str, str, str]:
    """(phase, the reason of the Ready condition, message)."""
    for problem in problems:
        phase = "Pending" if problem.reason == APPLY_RETRYING else "Failed"
        return phase, problem.reason, problem.message
    if troubles:
        trouble = troubles[0]
        phase = "Pending" if trouble.reason in _WAITING else "Degraded"
        return phase, trouble.reason.value, trouble.message
    if ready >= replicas:
        return "Ready", "Ready", f"{ready}/{replicas} replicas ready"
    started = [n for n in nodes if n["loader"] != LoaderState.WAITING.value]
    if started:
        return "Loading", "Loading", (
            f"{cached}/{replicas} nodes cached, {ready}/{replicas} replicas ready")
    return "Pending", "Pending", f"{len(nodes)}/{replicas} pods created, no loader started yet"


def _conditions(phase: str, reason: str, message: str, ready: int, cached: int, replicas: int,
                troubles: list[Trouble], problems: Sequence[Condition]) -> list[Condition]:
    failed = {p.type: p for p in problems}
    valid = failed.get(VALID) or Condition(VALID, TRUE, "SpecValid",
                                           "the spec passed the schema and settings validation")
    applied = failed.get(APPLIED) or Condition(
        APPLIED, TRUE, "ChildrenApplied", "the ConfigMap, Services and StatefulSet are applied")
    loader_trouble = next((t for t in troubles if t.container == LOADER_CONTAINER), None)
    if cached >= replicas:
        cache = Condition("CacheReady", TRUE, "AllNodesCached",
                          f"{cached}/{replicas} nodes hold the checkpoint")
    elif loader_trouble is not None:
        cache = Condition("CacheReady", FALSE, loader_trouble.reason.value, loader_trouble.message)
    else:
        cache = Condition("CacheReady", FALSE, "Loading",
                          f"{cached}/{replicas} nodes hold the checkpoint")
    available = Condition("Available", TRUE if ready >= replicas else FALSE,
                          "ReplicasReady" if ready >= replicas else "ReplicasNotReady",
                          f"{ready}/{replicas} replicas ready")
    progressing = {
        "Failed": Condition(PROGRESSING, FALSE, reason, message),
        "Degraded": Condition(PROGRESSING, FALSE, reason, message),
        "Ready": Condition(PROGRESSING, FALSE, "Complete", message),
        UPDATING: Condition(PROGRESSING, TRUE, reason, message),
        "Loading": Condition(PROGRESSING, TRUE, "Loading", message),
        "Pending": Condition(PROGRESSING, TRUE, reason, message),
    }[phase]
    ready_condition = Condition(READY, TRUE if phase == "Ready" else FALSE, reason, message)
    return [valid, applied, cache, available, progressing, ready_condition]


def _loader_state(
    loader: Mapping[str, Any] | None, *, sidecar: bool,
) -> tuple[LoaderState, str, FillSummary | None]:
    """State, one-line message and parsed fill summary of the loader container status. A
    `sidecar` loader (the workload pod's) is ready once it published and then stays running; the
    prefill Job's loader holds the entry only once it ended well."""
    if not loader:
        return LoaderState.WAITING, "", None
    state = loader.get("state") or {}
    if "terminated" in state:
        term = state["terminated"] or {}
        summary = _summary(term.get("message"))
        if term.get("exitCode") == 0:
            return LoaderState.CACHED, "", summary
        return LoaderState.FAILED, _failure_text(term, summary), summary
    if "running" in state:
        # A sidecar loader stays up after its fill; its readiness probe says it published.
        published = sidecar and loader.get("ready")
        return (LoaderState.CACHED if published else LoaderState.RUNNING), "", None
    waiting = state.get("waiting") or {}
    if waiting.get("reason") in _FAILING_WAIT_REASONS:
        last = (loader.get("lastState") or {}).get("terminated") or {}
        detail = _failure_text(last, _summary(last.get("message"))) if last else (
            waiting.get("message") or "")
        return LoaderState.FAILED, f"{waiting['reason']}: {detail}".strip(": "), None
    return LoaderState.WAITING, "", None


def _failure_text(term: Mapping[str, Any], summary: FillSummary | None) -> str:
    if summary is not None and not summary.ok and summary.error:
        return summary.error[:_MESSAGE_LIMIT]
    text = _last_line(term.get("message"))
    return text or f"exit code {term.get('exitCode')} ({term.get('reason', 'Error')})"


def _summary(message: Any) -> FillSummary | None:
    """The loader's one-line fill summary, whole (a survivor's or a refill's runs past
    `_MESSAGE_LIMIT`); anything else (a log tail) is None."""
    line = _last_line(message, limit=None)
    try:
        return FillSummary.from_json(line) if line else None
    except DocumentError:
        return None


def _last_line(message: Any, limit: int | None = _MESSAGE_LIMIT) -> str:
    lines = [line.strip() for line in str(message or "").splitlines() if line.strip()]
    return lines[-1][:limit] if lines else ""


def _container_status(statuses: Any, name: str) -> Mapping[str, Any] | None:
    for status in statuses or ():
        if status.get("name") == name:
            return status
    return None


def _pod_ready(pod: Mapping[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or ()
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _revision(pod: Mapping[str, Any]) -> str | None:
    return ((pod.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_REVISION)


def _rank(meta: Mapping[str, Any]) -> int:
    index = (meta.get("labels") or {}).get(LABEL_POD_INDEX)
    if index is None:
        index = str(meta.get("name", "")).rpartition("-")[2]
    return int(index) if str(index).isdigit() else -1
