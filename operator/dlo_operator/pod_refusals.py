"""Pods the API server refused to create, read from their controller's `FailedCreate` Events.

A pod that Pod Security, a ResourceQuota, a missing PriorityClass or ServiceAccount (any
admission) refuses never exists, so no pod status tells of it: only the controller that tried
says so, in a Warning Event with reason `FailedCreate` on itself. The StatefulSet controller
writes `create Pod <pod> in StatefulSet <set> failed error: <the API's words>`, the Job
controller `Error creating: <the API's words>`. `refusal` turns the latest such Event of one
controller into a `Trouble` (`FailedCreate`) naming the pod and the API's words, unless a pod of
that controller was created after it (the refusal is over). `refusal` is pure; `observe`,
which the reconciler calls, reads the Events of each controller that has fewer pods than it
asks for (the only time a refusal matters), one list request each.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Mapping, Sequence
from typing import Any

from dlo_operator.kube import KubeClient
from dlo_operator.naming import LABEL_REVISION, labels_of
from dlo_operator.pod_troubles import Trouble, TroubleReason

FAILED_CREATE = "FailedCreate"
_STATEFULSET_WORDS = re.compile(r"^create Pod (?P<pod>\S+) in StatefulSet \S+ failed error: ")
_JOB_WORDS = re.compile(r"^Error creating: ")
_POD_NAMED = re.compile(r'^pods "(?P<pod>[^"]+)"')


def observe(kube: KubeClient, namespace: str, statefulset: Mapping[str, Any] | None,
            workload: Sequence[Mapping[str, Any]], jobs: Sequence[Mapping[str, Any]],
            job_pods: Sequence[Mapping[str, Any]]) -> dict[str, Trouble]:
    """The current refusal of each controller short of pods, by the controller's name."""
    found: dict[str, Trouble] = {}
    short = []
    if statefulset is not None and len(_alive(workload)) < _wanted(statefulset, "replicas"):
        short.append(({**statefulset, "kind": "StatefulSet"}, _alive(workload)))
    for job in jobs:
        rev = labels_of(job).get(LABEL_REVISION)
        pods = [p for p in job_pods if labels_of(p).get(LABEL_REVISION) == rev]
        if not (job.get("status") or {}).get("conditions") and len(pods) < _wanted(
                job, "parallelism"):
            short.append(({**job, "kind": "Job"}, pods))
    for controller, pods in short:
        name = controller["metadata"]["name"]
        events = kube.events_about(controller["kind"], namespace, name)
        if (trouble := refusal(controller, events, pods)) is not None:
            found[name] = trouble
    return found


def _alive(pods: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")]


def _wanted(controller: Mapping[str, Any], field: str) -> int:
    return int((controller.get("spec") or {}).get(field) or 0)


def refusal(controller: Mapping[str, Any], events: Sequence[Mapping[str, Any]],
            pods: Sequence[Mapping[str, Any]]) -> Trouble | None:
    """The current refusal of a pod of `controller` (a StatefulSet or a Job), or None."""
    meta = controller.get("metadata") or {}
    kind, name, uid = controller.get("kind", ""), meta.get("name"), meta.get("uid")
    mine = [e for e in events if e.get("reason") == FAILED_CREATE and _about(e, kind, name, uid)]
    if not mine:
        return None
    latest = max(mine, key=_when)
    created = [_time((p.get("metadata") or {}).get("creationTimestamp")) for p in pods]
    if any(at is not None and at > _when(latest) for at in created):
        return None
    pod, words = _words(str(latest.get("message") or ""))
    return Trouble(TroubleReason.FAILED_CREATE, pod, "", "",
                   f"the API server refused the pod {kind} {name} creates: {words}")


def _about(event: Mapping[str, Any], kind: str, name: str | None, uid: str | None) -> bool:
    regarding = event.get("involvedObject") or {}
    return (regarding.get("kind"), regarding.get("name")) == (kind, name) and (
        not uid or not regarding.get("uid") or regarding.get("uid") == uid)


def _words(message: str) -> tuple[str, str]:
    """(the refused pod's name, or "" when the message names none; the API's words)."""
    pod = ""
    found = _STATEFULSET_WORDS.match(message)
    if found:
        pod, message = found.group("pod"), message[found.end():]
    elif (found := _JOB_WORDS.match(message)) is not None:
        message = message[found.end():]
    named = _POD_NAMED.match(message)
    return pod or (named.group("pod") if named else ""), message.strip()


def _when(event: Mapping[str, Any]) -> datetime.datetime:
    """The last time the controller met the refusal (an aggregated Event counts on)."""
    for text in ((event.get("series") or {}).get("lastObservedTime"), event.get("lastTimestamp"),
                 event.get("eventTime"), event.get("firstTimestamp"),
                 (event.get("metadata") or {}).get("creationTimestamp")):
        if (moment := _time(text)) is not None:
            return moment
    return datetime.datetime.min.replace(tzinfo=datetime.timezone.utc)


def _time(text: Any) -> datetime.datetime | None:
    """An RFC 3339 time of the API (seconds or microseconds), None when absent or unreadable."""
    if not isinstance(text, str) or not text:
        return None
    try:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
