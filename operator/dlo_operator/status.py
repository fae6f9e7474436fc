"""`status_from_pods`: the DOD status (phase, conditions, per-node cache state) from its pods.

Reads each workload pod's loader init container: its state (waiting, running, terminated,
crash-looping) and its termination message, the one-line JSON summary of contract C2. Pure: the
handlers pass the pods (from kopf's in-memory index), the previous status (to keep condition
transition times) and the clock. It must not call the cluster or read the settings document.

Phases, first match wins:
    Failed     the spec is invalid (`Valid=False`); nothing was created
    Degraded   a loader keeps failing, or an inference container cannot start
    Ready      every replica's pod is Ready
    Loading    a loader or an inference server has started
    Pending    no loader has started yet (unscheduled, pulling images)
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any

from dlo_contract.documents import DocumentError, FillSummary
from dlo_operator.naming import (
    INFERENCE_CONTAINER,
    LABEL_JOB_INDEX,
    LABEL_POD_INDEX,
    LOADER_CONTAINER,
)

CONDITION_TYPES = ("Valid", "CacheReady", "Available", "Progressing")
_FAILING_WAIT_REASONS = frozenset({
    "CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "InvalidImageName",
    "CreateContainerConfigError", "CreateContainerError", "RunContainerError",
})
_MESSAGE_LIMIT = 512


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
    state, message, summary = _loader_state(loader)
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
    entry.update(_figures(summary))
    return entry


def _figures(summary: FillSummary | None) -> dict[str, Any]:
    """The loader summary's figures under their status names (absent ones left out)."""
    if summary is None:
        return {}
    figures = {"entryId": summary.entry_id, "mode": summary.mode,
               "bytesFromStore": summary.bytes_from_store,
               "bytesFromPeers": summary.bytes_from_peers, "seconds": summary.seconds,
               "cached": summary.cached}
    return {name: value for name, value in figures.items() if value is not None}


def prefill_node(pod: Mapping[str, Any]) -> dict[str, Any]:
    """One prefill Job pod's row: node, rank, loader state and the loader's summary figures."""
    meta = pod.get("metadata") or {}
    loader = _container_status((pod.get("status") or {}).get("containerStatuses"),
                               LOADER_CONTAINER)
    state, message, summary = _loader_state(loader)
    index = (meta.get("labels") or {}).get(LABEL_JOB_INDEX, "")
    row: dict[str, Any] = {
        "pod": meta.get("name", ""), "node": (pod.get("spec") or {}).get("nodeName", ""),
        "rank": int(index) if str(index).isdigit() else -1, "loader": state.value,
    }
    if message:
        row["message"] = message
    row.update(_figures(summary))
    return row


def status_from_pods(
    pods: Sequence[Mapping[str, Any]],
    *,
    replicas: int,
    previous: Mapping[str, Any] | None,
    now: str,
    invalid_message: str | None = None,
) -> dict[str, Any]:
    """The status fields this operator owns. `invalid_message` (the validator's message) marks
    the spec invalid: phase Failed and `Valid=False`."""
    live = [p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")]
    nodes = sorted((node_entry(p) for p in live), key=lambda n: (n["rank"], n["pod"]))
    ready = sum(1 for n in nodes if n["ready"])
    cached = sum(1 for n in nodes if n["loader"] == LoaderState.CACHED.value)
    failure = _first_failure(nodes, live)
    phase, message = _phase(nodes, ready, cached, replicas, failure, invalid_message)
    conditions = _conditions(phase, message, ready, cached, replicas, failure, invalid_message)
    old = {c.get("type"): c for c in (previous or {}).get("conditions") or ()}
    status: dict[str, Any] = {
        "phase": phase,
        "message": message,
        "replicas": replicas,
        "readyReplicas": ready,
        "cachedReplicas": cached,
        "ready": f"{ready}/{replicas}",
        "cache": f"{cached}/{replicas}",
        "nodes": nodes,
        "conditions": [_stamp(c, old.get(c["type"]), now) for c in conditions],
    }
    return status


def _phase(nodes: list[dict[str, Any]], ready: int, cached: int, replicas: int,
           failure: str | None, invalid: str | None) -> tuple[str, str]:
    if invalid is not None:
        return "Failed", invalid
    if failure is not None:
        return "Degraded", failure
    if ready >= replicas:
        return "Ready", f"{ready}/{replicas} replicas ready"
    started = [n for n in nodes if n["loader"] != LoaderState.WAITING.value]
    if started:
        return "Loading", f"{cached}/{replicas} nodes cached, {ready}/{replicas} replicas ready"
    return "Pending", f"{len(nodes)}/{replicas} pods created, no loader started yet"


def _conditions(phase: str, message: str, ready: int, cached: int, replicas: int,
                failure: str | None, invalid: str | None) -> list[dict[str, str]]:
    valid = ("False", "SpecInvalid", invalid) if invalid is not None else (
        "True", "SpecValid", "the spec passed the settings validation")
    if cached >= replicas:
        cache = ("True", "AllNodesCached", f"{cached}/{replicas} nodes hold the checkpoint")
    elif failure is not None and failure.startswith("loader"):
        cache = ("False", "LoaderFailed", failure)
    else:
        cache = ("False", "Loading", f"{cached}/{replicas} nodes hold the checkpoint")
    available = ("True", "ReplicasReady", f"{ready}/{replicas} replicas ready") if (
        ready >= replicas) else ("False", "ReplicasNotReady", f"{ready}/{replicas} replicas ready")
    progressing = {
        "Failed": ("False", "SpecInvalid", message),
        "Degraded": ("False", "Stalled", message),
        "Ready": ("False", "Complete", message),
        "Loading": ("True", "Loading", message),
        "Pending": ("True", "Pending", message),
    }[phase]
    rows = zip(CONDITION_TYPES, (valid, cache, available, progressing))
    return [{"type": t, "status": s, "reason": r, "message": m} for t, (s, r, m) in rows]


def _stamp(condition: dict[str, str], old: Mapping[str, Any] | None, now: str) -> dict[str, str]:
    """Keep the old transition time while the condition's status does not change."""
    same = old is not None and old.get("status") == condition["status"]
    time = old.get("lastTransitionTime") if same and old else None
    return {**condition, "lastTransitionTime": time or now}


def _first_failure(nodes: list[dict[str, Any]], pods: list[Mapping[str, Any]]) -> str | None:
    for node in nodes:
        if node["loader"] == LoaderState.FAILED.value:
            where = node["node"] or "an unscheduled node"
            return (f"loader on {where} (pod {node['pod']}, {node['restarts']} restarts) "
                    f"failed: {node.get('message', 'no message')}")
    for pod in pods:
        inference = _container_status((pod.get("status") or {}).get("containerStatuses"),
                                      INFERENCE_CONTAINER)
        waiting = ((inference or {}).get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in _FAILING_WAIT_REASONS:
            name = (pod.get("metadata") or {}).get("name", "")
            detail = waiting.get("message") or _last_message(inference) or "no message"
            return f"inference container of pod {name} is in {waiting['reason']}: {detail}"
    return None


def _loader_state(
    loader: Mapping[str, Any] | None,
) -> tuple[LoaderState, str, FillSummary | None]:
    """State, one-line message and parsed fill summary of the loader container status."""
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
        return LoaderState.RUNNING, "", None
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
    """The loader's one-line fill summary; anything else (a log tail) is None."""
    line = _last_line(message)
    try:
        return FillSummary.from_json(line) if line else None
    except DocumentError:
        return None


def _last_line(message: Any) -> str:
    lines = [line.strip() for line in str(message or "").splitlines() if line.strip()]
    return lines[-1][:_MESSAGE_LIMIT] if lines else ""


def _last_message(container: Mapping[str, Any] | None) -> str:
    last = ((container or {}).get("lastState") or {}).get("terminated") or {}
    return _last_line(last.get("message"))


def _container_status(statuses: Any, name: str) -> Mapping[str, Any] | None:
    for status in statuses or ():
        if status.get("name") == name:
            return status
    return None


def _pod_ready(pod: Mapping[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or ()
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _rank(meta: Mapping[str, Any]) -> int:
    index = (meta.get("labels") or {}).get(LABEL_POD_INDEX)
    if index is None:
        index = str(meta.get("name", "")).rpartition("-")[2]
    return int(index) if str(index).isdigit() else -1
