"""`decide`: from what the cluster holds to what it should hold, one step of the day-two lifecycle.

Pure: the reconciler passes the observed children and pods, the previous prefill record and the
clock; `decide` returns the manifests that should exist (the reconciler applies only those that
drifted), what to delete (superseded prefill Jobs and settings, the optional children the spec
turned off), the new prefill record and the Events to post. Stages:

    Creating     no StatefulSet: create it with every pod in one fill group
    Serving      the StatefulSet serves the desired revision; scale by stepping `replicas`, new
                 pods in a fresh fill group (no existing pod restarts), one group at a time;
                 close a group once its members finished or one of them was scaled away;
                 the fill-group document names the nodes that hold the entry (`entry_holders`),
                 which a pod recreated alone reads it from
    Restarting   the settings changed but not the entry, or the prefill succeeded: roll the
                 pods at the live replica count; a scale-up waits one step, for Serving to
                 give its new pods a group
    Prefilling   the entry changed: a prefill Job fills it on every serving node while the old
                 pods keep serving; the StatefulSet is left as it is until the Job succeeds
    Backoff      the prefill failed: old pods keep serving; the next attempt waits out a
                 doubling delay
Prefilling and Backoff are `prefill_stage`'s; the types of a step live in `decision`.
A prefill left unfinished when the spec stops asking for it (the model reverted during the
prefill or its backoff) is superseded: its record ends there, and no retry follows.

Must not call the cluster (that is `reconcile`), nor compute the pods' status (`status`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from dlo_contract.fill_group import FillGroup, Holder
from dlo_operator.configmap import (
    build_configmap,
    build_fill_group_configmap,
    entry_key,
    revision,
)
from dlo_operator.decision import Decision, Observed, Stage
from dlo_operator.manifests import fill_group, optional_children, restart_children
from dlo_operator.naming import Owner
from dlo_operator.prefill_stage import (
    BackoffConfig,
    PrefillState,
    abandon,
    prefill_step,
    serving_nodes,
)
from dlo_operator.service import build_service
from dlo_operator.spec import DeploymentSpec
from dlo_operator.statefulset import build_statefulset, live_replicas, template_revision
from dlo_operator.status import LoaderState, node_entry


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
    elif serving[1] == key or not serving_nodes(seen.pods):
        decision = Decision(stage=Stage.RESTARTING, message=(
            f"restarting pods into revision {rev}: the cache entry is unchanged, no prefill"))
        decision.apply = restart_children(owner, spec, live_replicas(seen.statefulset))
        _carry(seen.prefill, rev, decision)
    else:
        decision = prefill_step(owner, spec, seen, backoff)
    decision.message += _held_scale(decision.stage, live_replicas(seen.statefulset),
                                    spec.replicas)
    decision.revision = rev
    optional = optional_children(owner, spec)
    decision.apply += optional
    decision.delete += _turned_off(optional, seen.optional)
    decision.delete += _stale_jobs(owner, rev, seen.jobs)
    decision.delete += _unused_settings(owner, rev, serving, seen)
    return decision


def _serve(owner: Owner, spec: DeploymentSpec, seen: Observed) -> Decision:
    """Steady state: children as the spec says; a scale-up fills its new pods as one group."""
    live = live_replicas(seen.statefulset)
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
    group = dataclasses.replace(group, holders=entry_holders(spec, seen.pods))
    decision.apply = [build_configmap(owner, spec), build_fill_group_configmap(owner, group),
                      build_service(owner, spec), build_statefulset(owner, spec, replicas)]
    _carry(seen.prefill, revision(spec), decision)
    return decision


def entry_holders(spec: DeploymentSpec, pods: Sequence[Mapping[str, Any]]) -> tuple[Holder, ...]:
    """The nodes whose pod's loader published its entry and stays up serving it to the DOD's
    loaders that refill another node (`dlo_loader.peer_serve`), one per node, by node name:
    where a pod recreated alone reads its entry before the store. A holder of another entry
    (an older revision's) is asked once and skipped by the loader, which checks the entry. None
    when the loaders serve nothing (`loader.metricsPort` or `loader.peerServeBytesPerSecond`
    0)."""
    loader = spec.settings.loader
    if not loader.metrics_port or not loader.peer_serve_bytes_per_second:
        return ()
    found: dict[str, Holder] = {}
    for pod in pods:
        row, address = node_entry(pod), (pod.get("status") or {}).get("podIP")
        if (row["loader"] == LoaderState.CACHED.value and row["node"] and address
                and not (pod.get("metadata") or {}).get("deletionTimestamp")):
            found.setdefault(row["node"], Holder(row["node"], address, loader.metrics_port))
    return tuple(found[node] for node in sorted(found))


def _carry(record: Mapping[str, Any], rev: str, decision: Decision) -> None:
    """Outside a prefill the previous record stays as it is, unless it is unfinished (running,
    or failed and waiting for its retry): no attempt of it follows any more (the model was
    reverted, or no pod serves an older entry), so it ends (`prefill_stage.abandon`)."""
    decision.prefill = dict(record)
    if record.get("state") not in (PrefillState.RUNNING.value, PrefillState.FAILED.value):
        return
    why = (f"the spec asks for revision {rev} now" if record.get("revision") != rev else
           f"no pod serves an older revision, so the pods of revision {rev} fill it themselves")
    decision.prefill, report = abandon(record, why)
    decision.reports.append(report)


def _held_scale(stage: Stage, live: int, wanted: int) -> str:
    """What a scale asked for outside Serving waits for, as a clause of the stage message: the
    prefill leaves the StatefulSet as it is; a restart applies a scale-down at once and a
    scale-up after it (`manifests.restart_children`)."""
    if stage in (Stage.PREFILLING, Stage.BACKOFF) and wanted != live:
        return "; " + _scale_waits(live, wanted, "the prefill")
    if stage is Stage.RESTARTING and wanted > live:
        return "; " + _scale_waits(live, wanted, (
            "the restart to be applied (its new pods then fill as one group)"))
    return ""


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
