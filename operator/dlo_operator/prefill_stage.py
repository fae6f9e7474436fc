"""The Prefilling and Backoff stages of `rollout.decide`: a new cache entry is filled on every
serving node by a prefill Job while the old pods serve, and only then do the pods restart.

`prefill_step` reads the prefill Job, its pods and the previous `status.prefill` record and
says what to keep applied, the new record and the Events: the Job started (`PrefillStarted`),
running (its pods' rows; a pod that cannot start its loader, or whose loader shows no progress
(`prefill_watch`), is named, `Decision.stuck`, and one that can never be scheduled, pinned to a node no pod of the DOD runs on any more, fails the
attempt), succeeded (restart the pods, once the loaders' summaries are in), failed (delete it;
retry after a doubling delay, `BackoffConfig`). Each outcome is one function that words its
Decision and Event; the record is a `prefill_record.PrefillRecord`. Pure; called by `rollout`
only. The Job and its Service are built by `prefill`; must not call the cluster.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from dlo_operator.conditions import EventType, Report
from dlo_operator.configmap import build_configmap, entry_key, revision
from dlo_operator.decision import Decision, Observed, Stage
from dlo_operator.manifests import restart_children
from dlo_operator.naming import LABEL_REVISION, Owner, labels_of
from dlo_operator.pod_troubles import NOT_STARTING, Trouble, TroubleReason, pod_troubles
from dlo_operator.prefill import build_prefill_job, build_prefill_service, pinned_nodes
from dlo_operator.prefill_record import (
    PrefillRecord, PrefillState, format_time, parse_time, record_of,
)
from dlo_operator.prefill_watch import no_progress, unfinished
from dlo_operator.spec import DeploymentSpec
from dlo_operator.statefulset import live_replicas
from dlo_operator.status import LoaderState, prefill_node


@dataclass(frozen=True, kw_only=True)
class BackoffConfig:
    """Delay before the next prefill attempt: `base_s * 2^(attempt-1)`, at most `max_s`."""

    base_s: float = 10.0
    max_s: float = 600.0

    def delay_s(self, attempt: int) -> float:
        return min(self.base_s * 2 ** max(attempt - 1, 0), self.max_s)


def prefill_step(owner: Owner, spec: DeploymentSpec, seen: Observed,
                 backoff: BackoffConfig) -> Decision:
    """The entry changed: fill it on the serving nodes first; roll only once all hold it. The
    record of another revision's prefill is handed over first (`_handover`)."""
    previous, ended = _handover(seen.prefill, revision(spec), entry_key(spec))
    decision = _step(owner, spec, seen, backoff, previous)
    decision.reports[:0] = ended
    return decision


def _handover(status: Mapping[str, Any], rev: str,
              key: str) -> tuple[PrefillRecord | None, list[Report]]:
    """The record `rev`'s prefill continues from, and the Events that end another revision's.
    A failed prefill of the same cache entry (a settings edit that keeps the entry, made during
    its backoff) is continued: its attempts, reason and retry time carry over. Any other
    unfinished prefill ends (`abandon`): the spec asks for `rev` now."""
    record = PrefillRecord.read(status)
    if record is None or record.revision == rev:
        return record, []
    if record.state is PrefillState.FAILED and record.entry_key == key:
        return replace(record, revision=rev), []
    if record.state not in (PrefillState.RUNNING, PrefillState.FAILED):
        return None, []
    return None, [abandon(status, f"the spec asks for revision {rev} now")[1]]


def abandon(status: Mapping[str, Any], why: str) -> tuple[dict[str, Any], Report]:
    """End the unfinished prefill `status` records, which no attempt follows any more: kept as
    history, state Superseded, without its retry time. A running attempt ends here, with a
    Normal Event `PrefillSuperseded` (its Job is deleted); a failed one ended with its
    `PrefillFailed`, so only its retry is cancelled (`PrefillRetryCancelled`): every attempt
    that starts ends with exactly one of PrefillSucceeded, PrefillFailed, PrefillSuperseded."""
    state = str(status.get("state"))
    message = (f"prefill of revision {status.get('revision')} (attempt {status.get('attempt')}, "
               f"{state.lower()}) superseded: {why}")
    record = {**{key: value for key, value in status.items() if key != "retryAt"},
              "state": PrefillState.SUPERSEDED.value, "message": message}
    reason = ("PrefillSuperseded" if state == PrefillState.RUNNING.value
              else "PrefillRetryCancelled")
    return record, Report(type=EventType.NORMAL, reason=reason, message=message)


def _step(owner: Owner, spec: DeploymentSpec, seen: Observed, backoff: BackoffConfig,
          previous: PrefillRecord | None) -> Decision:
    rev = revision(spec)
    job = next((j for j in seen.jobs if j["metadata"]["name"] == owner.prefill_name(rev)), None)
    keep = [build_configmap(owner, spec), build_prefill_service(owner, spec)]
    if job is None:
        return _without_job(owner, spec, seen, previous, keep)
    pods = [p for p in seen.job_pods if labels_of(p).get(LABEL_REVISION) == rev]
    nodes = sorted((prefill_node(p) for p in pods), key=lambda n: (n["rank"], n["pod"]))
    record = record_of(rev, entry_key(spec), max(previous.attempt if previous else 0, 1), nodes)
    state, stuck = _job_state(job), None
    if state is PrefillState.RUNNING and (stuck := seen.refused.get(job["metadata"]["name"])
                                          or _stuck(pods)) is not None and (
            gone := _gone(job, stuck, seen.pods)):
        why = (f"{stuck.message}; the Job is pinned to {', '.join(gone)}, where no pod of this "
               "DOD runs any more, so the next attempt fills the nodes that serve now")
        return _failed(owner, record, seen, backoff, keep, why)
    if state is PrefillState.SUCCEEDED and _summaries_pending(nodes, job, seen.now):
        # The Job's success and its pods' termination messages arrive as separate events: the
        # record is final once the pods restart, so wait for the loaders' figures.
        return _running(record, keep, (
            f"prefill of revision {rev} succeeded; waiting for the loaders' summaries "
            f"({_cached(nodes)}/{_completions(job, nodes)})"))
    if state is PrefillState.SUCCEEDED:
        return _succeeded(owner, spec, seen, record)
    if state is PrefillState.FAILED:
        return _failed(owner, record, seen, backoff, keep, _failure(
            nodes or list(previous.nodes if previous else ()), job))
    if stuck is None and spec.settings.loader.metrics_port:
        stuck = no_progress(pods, seen.progress, seen.now, spec.loader.progress_deadline_s)
    where = (f"prefill of revision {rev} is stuck: {stuck.message}" if stuck else
             f"prefilling revision {rev}: {_cached(nodes)}/{_completions(job, nodes)} nodes "
             "hold the entry")
    decision = _running(record, keep, f"{where}; the old pods keep serving")
    decision.stuck = stuck
    return decision


def _without_job(owner: Owner, spec: DeploymentSpec, seen: Observed,
                 previous: PrefillRecord | None, keep: list[dict[str, Any]]) -> Decision:
    """No Job of this revision: wait out the backoff of a failed attempt, else start one."""
    rev, attempt = revision(spec), previous.attempt if previous else 0
    if (previous is not None and previous.state is PrefillState.FAILED
            and previous.retry_at and seen.now < previous.retry_at):
        decision = Decision(stage=Stage.BACKOFF, message=(  # the reason stays on show
            f"prefill of revision {rev} failed (attempt {attempt}): {previous.message}; old "
            f"pods keep serving; next attempt at {format_time(previous.retry_at)}"), apply=keep)
        decision.prefill = previous.to_status()
        return decision
    nodes = serving_nodes(seen.pods)
    decision = Decision(stage=Stage.PREFILLING, message=(
        f"prefilling revision {rev} on {len(nodes)} nodes while the old pods serve"))
    decision.apply = keep + [build_prefill_job(owner, spec, nodes)]
    decision.prefill = PrefillRecord(revision=rev, state=PrefillState.RUNNING,
                                     attempt=attempt + 1, entry_key=entry_key(spec),
                                     message=f"filling on {', '.join(nodes)}").to_status()
    decision.reports.append(Report(type=EventType.NORMAL, reason="PrefillStarted", message=(
        f"prefilling the cache entry of revision {rev} on {len(nodes)} nodes "
        f"({', '.join(nodes)}), attempt {attempt + 1}; the old pods keep serving")))
    return decision


def _running(record: PrefillRecord, keep: list[dict[str, Any]], message: str) -> Decision:
    decision = Decision(stage=Stage.PREFILLING, message=message, apply=keep)
    decision.prefill = record.with_state(PrefillState.RUNNING, message).to_status()
    return decision


def _succeeded(owner: Owner, spec: DeploymentSpec, seen: Observed,
               record: PrefillRecord) -> Decision:
    """Every node holds the entry: restart the pods and delete the Job."""
    held = (f"{len(record.nodes)}/{len(record.nodes)} nodes hold the entry, "
            f"{record.bytes_from_store} bytes read from the store")
    decision = Decision(stage=Stage.RESTARTING, message=(
        f"every node holds the entry of revision {record.revision}; restarting pods"))
    decision.apply = restart_children(owner, spec, live_replicas(seen.statefulset))
    decision.delete = [("Job", owner.prefill_name(record.revision))]
    decision.prefill = record.with_state(PrefillState.SUCCEEDED, held).to_status()
    decision.reports.append(Report(type=EventType.NORMAL, reason="PrefillSucceeded",
                                   message=f"revision {record.revision}: {held}; "
                                           "restarting pods"))
    return decision


def _failed(owner: Owner, record: PrefillRecord, seen: Observed, backoff: BackoffConfig,
            keep: list[dict[str, Any]], why: str) -> Decision:
    """The attempt failed: delete the Job and try again after the backoff."""
    delay = backoff.delay_s(record.attempt)
    retry_at = seen.now + datetime.timedelta(seconds=delay)
    rev = record.revision
    decision = Decision(stage=Stage.BACKOFF, message=(
        f"prefill of revision {rev} failed: {why}; old pods keep serving"), apply=keep)
    decision.delete = [("Job", owner.prefill_name(rev))]
    decision.prefill = record.with_state(PrefillState.FAILED, why,
                                         retry_at=retry_at).to_status()
    decision.reports.append(Report(type=EventType.WARNING, reason="PrefillFailed", message=(
        f"prefill of revision {rev} (attempt {record.attempt}) failed: {why}; the old "
        f"pods keep serving; retrying in {delay:.0f} s")))
    return decision


def _stuck(pods: Sequence[Mapping[str, Any]]) -> Trouble | None:
    """The first prefill pod that cannot start its loader: the Job alone would wait for it
    until its `activeDeadlineSeconds`."""
    return next((t for t in pod_troubles(pods, {}) if t.reason in NOT_STARTING), None)


def _gone(job: Mapping[str, Any], stuck: Trouble, pods: Sequence[Mapping[str, Any]]) -> list[str]:
    """Nodes the Job is pinned to where no pod of the DOD runs any more (a node replaced during
    the prefill), when a prefill pod cannot be scheduled: it never will be."""
    if stuck.reason is not TroubleReason.UNSCHEDULABLE:
        return []
    return sorted(set(pinned_nodes(job)) - set(serving_nodes(pods)))


def serving_nodes(pods: Sequence[Mapping[str, Any]]) -> list[str]:
    return sorted({str((p.get("spec") or {}).get("nodeName")) for p in pods
                   if (p.get("spec") or {}).get("nodeName")
                   and not (p.get("metadata") or {}).get("deletionTimestamp")})


SUMMARY_GRACE_S = 60.0
"""How long after a prefill Job completed the operator waits for its pods' summaries before it
records the prefill without them (pods removed by the pod garbage collector never report)."""
_NOT_ENDED = (LoaderState.WAITING.value, LoaderState.RUNNING.value)
"""A prefill pod's loader states before it ended: a completed Job beside one is waited for."""


def _cached(nodes: Sequence[Mapping[str, Any]]) -> int:
    return sum(1 for n in nodes if n["loader"] == LoaderState.CACHED.value)


def _completions(job: Mapping[str, Any], nodes: Sequence[Mapping[str, Any]]) -> int:
    return int((job.get("spec") or {}).get("completions") or len(nodes))


def _summaries_pending(nodes: Sequence[Mapping[str, Any]], job: Mapping[str, Any],
                       now: datetime.datetime) -> bool:
    """A completed Job whose pods' summaries this view does not all show yet: always while a
    pod it shows has a loader not ended (an Indexed Job completes once every index succeeded,
    so that view of the pod lags the Job's), else within the grace period after the Job's
    `completionTime` (no such time: wait)."""
    if any(n["loader"] in _NOT_ENDED for n in nodes):
        return True
    if _cached(nodes) >= _completions(job, nodes):
        return False
    done_at = parse_time((job.get("status") or {}).get("completionTime"))
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
            left = unfinished(nodes)
            return (f"Job {condition.get('reason', 'Failed')}: {condition.get('message', '')}"
                    + (f"; {left}" if left else ""))
    return "the prefill Job failed"
