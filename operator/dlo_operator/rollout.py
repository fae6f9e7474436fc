"""`decide`: from what the cluster holds to what it should hold, one step of the day-two lifecycle.

Pure: the reconciler passes the observed children and pods, the previous prefill record and the
clock; `decide` returns the manifests that should exist (the reconciler applies only those that
drifted), what to delete (superseded prefill Jobs and settings, the optional children the spec
turned off), the new prefill record and the Events to post. Stages:

    Creating     no StatefulSet: create it with every pod in one fill group
    Serving      the StatefulSet serves the desired revision; scale by stepping `replicas`, new
                 pods in a fresh fill group (no existing pod restarts), one group at a time;
                 close a group once its members finished or one of them was scaled away
    Restarting   the settings changed but not the entry: roll the pods, no prefill
    Prefilling   the entry changed: a prefill Job fills it on every serving node while the old
                 pods keep serving; the StatefulSet is left as it is until the Job succeeds
    Backoff      the prefill failed: old pods keep serving; the next attempt waits out a
                 doubling delay
A prefill left unfinished when the spec stops asking for it (the model reverted during the
prefill or its backoff) is superseded: its record ends there, and no retry follows.

Must not call the cluster (that is `reconcile`), nor compute the pods' status (`status`).
"""

from __future__ import annotations

import datetime
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dlo_contract.fill_group import FillGroup
from dlo_operator.conditions import EventType, Report
from dlo_operator.configmap import (
    build_configmap,
    build_fill_group_configmap,
    entry_key,
    revision,
)
from dlo_operator.manifests import fill_group, optional_children
from dlo_operator.naming import LABEL_REVISION, Owner
from dlo_operator.prefill import build_prefill_job, build_prefill_service
from dlo_operator.service import build_service
from dlo_operator.spec import DeploymentSpec
from dlo_operator.statefulset import build_statefulset, template_revision
from dlo_operator.status import LoaderState, node_entry, prefill_node


class Stage(str, enum.Enum):
    CREATING = "Creating"
    SERVING = "Serving"
    RESTARTING = "Restarting"
    PREFILLING = "Prefilling"
    BACKOFF = "Backoff"


class PrefillState(str, enum.Enum):
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    SUPERSEDED = "Superseded"
    """Ended unfinished: the spec no longer needs it (e.g. the model was reverted)."""


@dataclass(frozen=True, kw_only=True)
class BackoffConfig:
    """Delay before the next prefill attempt: `base_s * 2^(attempt-1)`, at most `max_s`."""

    base_s: float = 10.0
    max_s: float = 600.0

    def delay_s(self, attempt: int) -> float:
        return min(self.base_s * 2 ** max(attempt - 1, 0), self.max_s)


@dataclass(frozen=True, kw_only=True)
class Observed:
    statefulset: Mapping[str, Any] | None
    pods: Sequence[Mapping[str, Any]]
    """Workload pods of the DOD (deleting ones included)."""
    group: FillGroup | None
    """The published fill-group document; None when its ConfigMap is missing."""
    jobs: Sequence[Mapping[str, Any]]
    job_pods: Sequence[Mapping[str, Any]]
    settings_configmaps: Sequence[Mapping[str, Any]]
    prefill: Mapping[str, Any]
    """The previous `status.prefill` record ({} when none)."""
    now: datetime.datetime
    optional: Sequence[tuple[str, str]] = ()
    """(kind, name) of the optional children (`manifests.optional_child_names`) that exist and
    this DOD owns."""


@dataclass(kw_only=True)
class Decision:
    stage: Stage
    message: str
    revision: str = ""
    """The revision the spec asks for."""
    apply: list[dict[str, Any]] = field(default_factory=list)
    delete: list[tuple[str, str]] = field(default_factory=list)
    """(kind, name) of children to delete."""
    prefill: dict[str, Any] = field(default_factory=dict)
    reports: list[Report] = field(default_factory=list)


def decide(owner: Owner, spec: DeploymentSpec, seen: Observed,
           backoff: BackoffConfig) -> Decision:
    rev, key = revision(spec), entry_key(spec)
    serving = template_revision(dict(seen.statefulset) if seen.statefulset else None)
    if serving is None:
        decision = Decision(stage=Stage.CREATING, message=(
            f"creating {spec.replicas} pods of revision {rev}, filling as one group"))
        decision.apply = [build_configmap(owner, spec), build_fill_group_configmap(
            owner, fill_group(owner, spec, range(spec.replicas))), build_service(owner, spec),
            build_statefulset(owner, spec)]
        _carry(seen.prefill, rev, decision)
    elif serving[0] == rev:
        decision = _serve(owner, spec, seen)
    elif serving[1] == key or not _serving_nodes(seen.pods):
        decision = Decision(stage=Stage.RESTARTING, message=(
            f"restarting pods into revision {rev}: the cache entry is unchanged, no prefill"))
        decision.apply = [build_configmap(owner, spec),
                          build_fill_group_configmap(owner, FillGroup()),
                          build_service(owner, spec), build_statefulset(owner, spec)]
        _carry(seen.prefill, rev, decision)
    else:
        decision = _prefill(owner, spec, seen, backoff)
        live = _live_replicas(seen.statefulset)
        if live != spec.replicas:  # the StatefulSet is left as it is until the prefill ends
            decision.message += "; " + _scale_waits(live, spec.replicas, "the prefill")
    decision.revision = rev
    optional = optional_children(owner, spec)
    decision.apply += optional
    decision.delete += _turned_off(optional, seen.optional)
    decision.delete += _stale_jobs(owner, rev, seen.jobs)
    decision.delete += _unused_settings(owner, rev, serving, seen)
    return decision


def _serve(owner: Owner, spec: DeploymentSpec, seen: Observed) -> Decision:
    """Steady state: children as the spec says; a scale-up fills its new pods as one group."""
    live = _live_replicas(seen.statefulset)
    group = seen.group if seen.group is not None else FillGroup()
    if group.members and (group.revision != revision(spec) or _over(owner, spec, group,
                                                                     seen.pods)):
        group = FillGroup()  # a pod recreated later, or a member left, fills alone
    replicas, message = spec.replicas, f"serving revision {revision(spec)}"
    if spec.replicas > live:
        if group.members:
            replicas = live  # one group at a time: the next one waits for this one to finish
            message += "; " + _scale_waits(live, spec.replicas, (
                f"the fill group of {', '.join(sorted(group.members))} to finish "
                "(one group at a time)"))
        else:
            group = fill_group(owner, spec, range(live, spec.replicas))
            message = (f"scaling {live} -> {spec.replicas}: new pods fill as a group of "
                       f"{max(spec.replicas - live, 1)}, no serving pod restarts")
    elif spec.replicas < live:
        message = f"scaling {live} -> {spec.replicas}: removing pods, no other pod restarts"
    decision = Decision(stage=Stage.SERVING, message=message)
    decision.apply = [build_configmap(owner, spec), build_fill_group_configmap(owner, group),
                      build_service(owner, spec), build_statefulset(owner, spec, replicas)]
    _carry(seen.prefill, revision(spec), decision)
    return decision


def _carry(record: Mapping[str, Any], rev: str, decision: Decision) -> None:
    """Outside a prefill the previous record stays as it is, unless it is unfinished (running,
    or failed and waiting for its retry): no attempt of it follows any more (the model was
    reverted, or no pod serves an older entry), so it is superseded, kept as history without
    its retry time, with a Normal Event."""
    decision.prefill = dict(record)
    state = record.get("state")
    if state not in (PrefillState.RUNNING.value, PrefillState.FAILED.value):
        return
    why = (f"the spec asks for revision {rev} now" if record.get("revision") != rev else
           f"no pod serves an older revision, so the pods of revision {rev} fill it themselves")
    message = (f"prefill of revision {record.get('revision')} (attempt {record.get('attempt')}, "
               f"{str(state).lower()}) superseded: {why}")
    decision.prefill = {**{key: value for key, value in record.items() if key != "retryAt"},
                        "state": PrefillState.SUPERSEDED.value, "message": message}
    decision.reports.append(Report(type=EventType.NORMAL, reason="PrefillSuperseded",
                                   message=message))


def _prefill(owner: Owner, spec: DeploymentSpec, seen: Observed,
             backoff: BackoffConfig) -> Decision:
    """The entry changed: fill it on the serving nodes first; roll only once all hold it."""
    rev = revision(spec)
    name = owner.prefill_name(rev)
    job = next((j for j in seen.jobs if j["metadata"]["name"] == name), None)
    previous = dict(seen.prefill) if seen.prefill.get("revision") == rev else {}
    attempt = int(previous.get("attempt", 0))
    keep = [build_configmap(owner, spec), build_prefill_service(owner, spec)]
    if job is None:
        retry_at = _parse_time(previous.get("retryAt"))
        if previous.get("state") == PrefillState.FAILED.value and retry_at and (
                seen.now < retry_at):
            decision = Decision(stage=Stage.BACKOFF, message=(  # the reason stays on show
                f"prefill of revision {rev} failed (attempt {attempt}): {previous.get('message')}"
                f"; old pods keep serving; next attempt at {previous['retryAt']}"), apply=keep)
            decision.prefill = previous
            return decision
        nodes = _serving_nodes(seen.pods)
        decision = Decision(stage=Stage.PREFILLING, message=(
            f"prefilling revision {rev} on {len(nodes)} nodes while the old pods serve"))
        decision.apply = keep + [build_prefill_job(owner, spec, nodes)]
        decision.prefill = {"revision": rev, "state": PrefillState.RUNNING.value,
                            "attempt": attempt + 1, "nodes": [], "bytesFromStore": 0,
                            "message": f"filling on {', '.join(nodes)}"}
        decision.reports.append(Report(type=EventType.NORMAL, reason="PrefillStarted", message=(
            f"prefilling the cache entry of revision {rev} on {len(nodes)} nodes "
            f"({', '.join(nodes)}), attempt {attempt + 1}; the old pods keep serving")))
        return decision
    pods = [p for p in seen.job_pods if _labels(p).get(LABEL_REVISION) == rev]
    nodes = sorted((prefill_node(p) for p in pods), key=lambda n: (n["rank"], n["pod"]))
    record = {"revision": rev, "attempt": max(attempt, 1), "nodes": nodes,
              "bytesFromStore": sum(int(n.get("bytesFromStore", 0)) for n in nodes)}
    state = _job_state(job)
    if state is PrefillState.SUCCEEDED and _summaries_pending(nodes, job, seen.now):
        # The Job's success and its pods' termination messages arrive as separate events: the
        # record is final once the pods restart, so wait for the loaders' figures.
        decision = Decision(stage=Stage.PREFILLING, message=(
            f"prefill of revision {rev} succeeded; waiting for the loaders' summaries "
            f"({_cached(nodes)}/{_completions(job, nodes)})"), apply=keep)
        decision.prefill = {**record, "state": PrefillState.RUNNING.value,
                            "message": decision.message}
        return decision
    if state is PrefillState.SUCCEEDED:
        decision = Decision(stage=Stage.RESTARTING, message=(
            f"every node holds the entry of revision {rev}; restarting pods"))
        decision.apply = [build_configmap(owner, spec),
                          build_fill_group_configmap(owner, FillGroup()),
                          build_service(owner, spec), build_statefulset(owner, spec)]
        decision.delete = [("Job", name)]
        decision.prefill = {**record, "state": state.value, "message": (
            f"{len(nodes)}/{len(nodes)} nodes hold the entry, "
            f"{record['bytesFromStore']} bytes read from the store")}
        decision.reports.append(Report(type=EventType.NORMAL, reason="PrefillSucceeded",
                                       message=f"revision {rev}: {decision.prefill['message']}; "
                                               "restarting pods"))
        return decision
    if state is PrefillState.FAILED:
        delay = backoff.delay_s(record["attempt"])
        retry_at = _format_time(seen.now + datetime.timedelta(seconds=delay))
        why = _failure(nodes, job)
        decision = Decision(stage=Stage.BACKOFF, message=(
            f"prefill of revision {rev} failed: {why}; old pods keep serving"), apply=keep)
        decision.delete = [("Job", name)]
        decision.prefill = {**record, "state": state.value, "message": why,
                            "retryAt": retry_at}
        decision.reports.append(Report(type=EventType.WARNING, reason="PrefillFailed", message=(
            f"prefill of revision {rev} (attempt {record['attempt']}) failed: {why}; the old "
            f"pods keep serving; retrying in {delay:.0f} s")))
        return decision
    decision = Decision(stage=Stage.PREFILLING, message=(
        f"prefilling revision {rev}: {_cached(nodes)}/{_completions(job, nodes)} nodes "
        "hold the entry; the old pods keep serving"), apply=keep)
    decision.prefill = {**record, "state": PrefillState.RUNNING.value,
                        "message": decision.message}
    return decision


def _serving_nodes(pods: Sequence[Mapping[str, Any]]) -> list[str]:
    return sorted({str((p.get("spec") or {}).get("nodeName")) for p in pods
                   if (p.get("spec") or {}).get("nodeName")
                   and not (p.get("metadata") or {}).get("deletionTimestamp")})


def _live_replicas(statefulset: Mapping[str, Any] | None) -> int:
    return int(((statefulset or {}).get("spec") or {}).get("replicas") or 0)


def _scale_waits(live: int, wanted: int, why: str) -> str:
    return f"scaling {live} -> {wanted} waits for {why}"


def _over(owner: Owner, spec: DeploymentSpec, group: FillGroup,
          pods: Sequence[Mapping[str, Any]]) -> bool:
    """The group is over: every member's loader finished (cached, or failed for good), or a
    member was scaled away (a scale-up cancelled, or cut short, before its pods filled). A group
    missing a member can never meet: the members left fill alone (a loader already waiting for
    it falls back when its rendezvous times out, as `loader.onRendezvousTimeout` says).
    A member without a pod is not over: the StatefulSet has yet to create it."""
    wanted = {owner.pod_name(ordinal) for ordinal in range(spec.replicas)}
    if any(member not in wanted for member in group.members):
        return True
    by_name = {(p.get("metadata") or {}).get("name"): p for p in pods}
    states = [node_entry(by_name[m])["loader"] if m in by_name else None for m in group.members]
    return all(s in (LoaderState.CACHED.value, LoaderState.FAILED.value) for s in states)


SUMMARY_GRACE_S = 60.0
"""How long after a prefill Job completed the operator waits for its pods' summaries before it
records the prefill without them (pods removed by the pod garbage collector never report)."""


def _cached(nodes: Sequence[Mapping[str, Any]]) -> int:
    return sum(1 for n in nodes if n["loader"] == LoaderState.CACHED.value)


def _completions(job: Mapping[str, Any], nodes: Sequence[Mapping[str, Any]]) -> int:
    return int((job.get("spec") or {}).get("completions") or len(nodes))


def _summaries_pending(nodes: Sequence[Mapping[str, Any]], job: Mapping[str, Any],
                       now: datetime.datetime) -> bool:
    """A completed Job whose pods' summaries this view does not all show yet, within the grace
    period after its `completionTime` (no such time: wait)."""
    if _cached(nodes) >= _completions(job, nodes):
        return False
    done_at = _parse_time((job.get("status") or {}).get("completionTime"))
    return done_at is None or now < done_at + datetime.timedelta(seconds=SUMMARY_GRACE_S)


def _job_state(job: Mapping[str, Any]) -> PrefillState:
    for condition in (job.get("status") or {}).get("conditions") or ():
        if condition.get("status") == "True" and condition.get("type") == "Complete":
            return PrefillState.SUCCEEDED
        if condition.get("status") == "True" and condition.get("type") == "Failed":
            return PrefillState.FAILED
    return PrefillState.RUNNING


def _failure(nodes: Sequence[Mapping[str, Any]], job: Mapping[str, Any]) -> str:
    for node in nodes:
        if node["loader"] == LoaderState.FAILED.value:
            return (f"loader on {node['node'] or 'an unscheduled node'} (pod {node['pod']}): "
                    f"{node.get('message', 'no message')}")
    for condition in (job.get("status") or {}).get("conditions") or ():
        if condition.get("type") == "Failed":
            return f"Job {condition.get('reason', 'Failed')}: {condition.get('message', '')}"
    return "the prefill Job failed"


def _turned_off(wanted: Sequence[Mapping[str, Any]],
                existing: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """Optional children the spec no longer asks for (`disruptionBudget.enabled: false`, no
    `inference.ports`)."""
    keep = {(child["kind"], child["metadata"]["name"]) for child in wanted}
    return [child for child in existing if child not in keep]


def _stale_jobs(owner: Owner, rev: str, jobs: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """Prefill Jobs of revisions no longer wanted (the spec changed again meanwhile)."""
    wanted = owner.prefill_name(rev)
    return [("Job", j["metadata"]["name"]) for j in jobs if j["metadata"]["name"] != wanted]


def _unused_settings(owner: Owner, rev: str, serving: tuple[str, str] | None,
                     seen: Observed) -> list[tuple[str, str]]:
    """Settings ConfigMaps of revisions that neither the spec, the StatefulSet nor a pod uses."""
    used = {owner.settings_name(rev)}
    if serving is not None:
        used.add(owner.settings_name(serving[0]))
    for pod in seen.pods:
        for volume in (pod.get("spec") or {}).get("volumes") or ():
            if volume.get("configMap"):
                used.add(volume["configMap"].get("name"))
    return [("ConfigMap", c["metadata"]["name"]) for c in seen.settings_configmaps
            if c["metadata"]["name"] not in used]


def _labels(obj: Mapping[str, Any]) -> Mapping[str, str]:
    return (obj.get("metadata") or {}).get("labels") or {}


def _format_time(moment: datetime.datetime) -> str:
    return moment.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_time(text: Any) -> datetime.datetime | None:
    if not isinstance(text, str):
        return None
    try:
        return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(
            tzinfo=datetime.timezone.utc)
    except ValueError:
        return None
