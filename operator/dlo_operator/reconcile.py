"""`reconcile`: read what one DOD owns, let `rollout.decide` say what should be, make it so.

One path for every trigger (the DOD changed, one of its pods or children changed, the periodic
timer): observe the children and pods, decide, apply only the children that drifted from their
manifests (comparing just the fields this operator sets, so fields other controllers own are
never fought over), delete what is no longer used, post the Events, and write the status.

The spec is admitted first (`admission`: CRD verdict, settings validator, the platform's
choices, pod rules); a refused spec gets `Valid=False` and one Warning Event, and its children
stay as they are. An API error while applying gets `Applied=False` and a Warning Event per attempt:
conflicts, throttling, 5xx and timeouts are retried after `backoff_delay` (`ApplyRetrying`),
anything else (`ApplyFailed`) waits for the next change of the spec. A pod falling into
trouble (the `Ready` condition's reason), or a prefill pod that cannot start (`PrefillStuck`),
gets one Warning Event per new message.
Called by `handlers` under a per-DOD lock; the only caller of `rollout`.
"""

from __future__ import annotations

import datetime
import logging
import math
import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

from dlo_contract.fill_group import FILL_GROUP_KEY, FillGroup
from dlo_contract.names import FILL_SECRET_KEY
from dlo_operator import loader_image, metrics, pod_refusals
from dlo_operator.admission import admit
from dlo_operator.conditions import FALSE, Condition, find, post_event, report_event
from dlo_operator.decision import Decision, Observed
from dlo_operator.errors import KubeError, KubeTransientError, NameConflict, SpecError
from dlo_operator.fill_secret import build_fill_secret, new_data
from dlo_operator.installation import InstallationConfig
from dlo_operator.kube import KubeClient, backoff_delay
from dlo_operator.manifests import drifted, optional_child_names
from dlo_operator.naming import (
    KIND,
    LABEL_DEPLOYMENT,
    LABEL_ROLE,
    PREFILL_ROLE,
    UNCONTROLLED,
    Owner,
    foreign_controller,
    labels_of,
    owns,
)
from dlo_operator.prefill_stage import BackoffConfig
from dlo_operator.rollout import decide
from dlo_operator.rollout_status import PREFILL_STUCK, rollout_fields
from dlo_operator.status import (
    APPLIED,
    APPLY_RETRYING,
    PREFILLED,
    READY,
    TROUBLE_REASONS,
    VALID,
    status_from_pods,
)

log = logging.getLogger(__name__)
NAME_CONFLICT = "NameConflict"
"""The `Applied` reason of a DOD whose child name another DOD's (or controller's) object holds."""
_REPORTED_REASONS = {READY: TROUBLE_REASONS, PREFILLED: frozenset({PREFILL_STUCK})}
"""The failed reasons of these conditions that get an Event here (the others are reported
elsewhere, or are steps of a rollout)."""


def utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


@dataclass(frozen=True, kw_only=True)
class ReconcileConfig:
    backoff: BackoffConfig = BackoffConfig()
    """Prefill retries."""
    installation: InstallationConfig = InstallationConfig()
    """The platform's choices (the chart's values, `dlo operator run`'s flags)."""
    clock: Callable[[], datetime.datetime] = utc_now
    """The time every decision reads (prefill backoff, a prefill without progress) and the
    status is stamped with; tests move it instead of waiting."""


@dataclass(frozen=True, kw_only=True)
class ApplyRetry:
    """A failed apply of one DOD generation: when the next attempt may run (never, for a
    permanent failure: the next spec change retries) and the condition that reports it."""

    generation: int | None
    attempt: int
    not_before: float
    condition: Condition


Retries = MutableMapping[tuple[str, str], ApplyRetry]


def reconcile(kube: KubeClient, dod: Mapping[str, Any], config: ReconcileConfig,
              retries: Retries | None = None) -> Decision | None:
    """One step for `dod`; returns the decision (None for a refused spec). `retries` keeps the
    failed applies between steps (the handlers keep one per operator)."""
    retries = {} if retries is None else retries
    owner = Owner.from_body(dod)
    now = config.clock()
    previous = dict(dod.get("status") or {})
    generation = (dod.get("metadata") or {}).get("generation")
    pods = kube.list("Pod", owner.namespace, {LABEL_DEPLOYMENT: owner.name})
    workload = [p for p in pods if LABEL_ROLE not in labels_of(p)]
    try:
        spec = admit(dod, config.installation)
    except SpecError as exc:
        log.error("%s/%s: spec refused, children left as they are: %s", owner.namespace,
                  owner.name, exc)
        problem = Condition(VALID, FALSE, "SpecInvalid", str(exc))
        status = status_from_pods(workload, replicas=_replicas(dod.get("spec")),
                                  previous=previous, now=_stamp(now), generation=generation,
                                  problems=[problem])
        _report_new(dod, previous, status, (VALID,))
        _write_status(kube, owner, dod, previous, status)
        metrics.record_reconcile("invalid", owner, status, previous)
        return None
    seen = _observe(kube, owner, pods, workload, previous, now)
    image = loader_image.choose(owner, spec, dod, seen.statefulset, config.installation)
    decision = decide(owner, image.spec, seen, config.backoff)
    decision.message += loader_image.kept_clause(image, spec.loader.image)
    if (report := loader_image.restart_report(image, decision.apply, seen.statefulset)):
        decision.reports.append(report)
    problem = _apply(kube, owner, dod, decision, retries, generation)
    for report in decision.reports:
        post_event(dod, report)
    status = status_from_pods(workload, replicas=spec.replicas, previous=previous,
                              now=_stamp(now), generation=generation,
                              problems=[problem] if problem else [], revision=decision.revision,
                              loader_image=image.spec.loader.image,
                              refused=[t for name, t in seen.refused.items()
                                       if name == owner.statefulset_name])
    status.update(rollout_fields(owner, decision, status, previous, _stamp(now), generation))
    _report_new(dod, previous, status, (READY, PREFILLED))
    _write_status(kube, owner, dod, previous, status)
    outcome = "applied" if problem is None else (
        "retried" if problem.reason == APPLY_RETRYING else "failed")
    metrics.record_reconcile(outcome, owner, status, previous, decision.reports)
    return decision


def _apply(kube: KubeClient, owner: Owner, dod: Mapping[str, Any], decision: Decision,
           retries: Retries, generation: int | None) -> Condition | None:
    """Converge, unless an earlier failure of this generation says to wait. A new failure
    becomes an `Applied=False` condition and a Warning Event."""
    key = (owner.namespace, owner.name)
    before = retries.get(key)
    if before is not None and before.generation != generation:
        before = None
    if before is not None and time.monotonic() < before.not_before:
        return before.condition
    try:
        _converge(kube, owner, decision)
    except NameConflict as exc:
        retries.pop(key, None)
        condition = Condition(APPLIED, FALSE, NAME_CONFLICT, str(exc))
        if find(dod.get("status") or {}, APPLIED) != condition:
            report_event(dod, condition)
        return condition
    except KubeTransientError as exc:
        attempt = before.attempt + 1 if before is not None else 0
        delay = backoff_delay(attempt, exc.delay_s)
        condition = Condition(APPLIED, FALSE, APPLY_RETRYING,
                              f"{exc}; attempt {attempt + 2} in {delay:.0f} s")
        retries[key] = ApplyRetry(generation=generation, attempt=attempt,
                                  not_before=time.monotonic() + delay, condition=condition)
    except KubeError as exc:
        condition = Condition(APPLIED, FALSE, "ApplyFailed",
                              f"{exc}; retried when the spec changes ({exc.hint})")
        retries[key] = ApplyRetry(generation=generation, attempt=0, not_before=math.inf,
                                  condition=condition)
    else:
        retries.pop(key, None)
        return None
    report_event(dod, condition)
    return condition


def _report_new(dod: Mapping[str, Any], previous: Mapping[str, Any], status: Mapping[str, Any],
                kinds: Sequence[str]) -> None:
    """A Warning Event for each failed condition of `kinds` whose message is new (a refused
    spec; a pod in trouble, named by the `Ready` condition's reason; a prefill pod that cannot
    start, `Prefilled` reason `PrefillStuck`)."""
    for kind in kinds:
        now, before = find(status, kind), find(previous, kind)
        if now is None or not now.failed or (before is not None and before == now):
            continue
        if kind in _REPORTED_REASONS and now.reason not in _REPORTED_REASONS[kind]:
            continue
        report_event(dod, now)


def _observe(kube: KubeClient, owner: Owner, pods: list[dict[str, Any]],
             workload: list[dict[str, Any]], previous: Mapping[str, Any],
             now: datetime.datetime) -> Observed:
    group_map = kube.get("ConfigMap", owner.namespace, owner.fill_group_name)
    group = None
    if group_map is not None:
        try:
            group = FillGroup.from_json((group_map.get("data") or {}).get(FILL_GROUP_KEY, "{}"))
        except ValueError:
            group = FillGroup()
    mine = {LABEL_DEPLOYMENT: owner.name}
    statefulset = kube.get("StatefulSet", owner.namespace, owner.statefulset_name)
    jobs = kube.list("Job", owner.namespace, {**mine, LABEL_ROLE: PREFILL_ROLE})
    job_pods = [p for p in pods if labels_of(p).get(LABEL_ROLE) == PREFILL_ROLE]
    return Observed(
        statefulset=statefulset, pods=workload, group=group, jobs=jobs, job_pods=job_pods,
        refused=pod_refusals.observe(kube, owner.namespace, statefulset, workload, jobs,
                                     job_pods),
        settings_configmaps=kube.list("ConfigMap", owner.namespace,
                                      {**mine, LABEL_ROLE: "settings"}),
        prefill=previous.get("prefill") or {}, progress=previous.get("progress") or {},
        now=now,
        optional=[(kind, name) for kind, name in optional_child_names(owner)
                  if owns(owner, kube.get(kind, owner.namespace, name))])


def _converge(kube: KubeClient, owner: Owner, decision: Decision) -> None:
    """Apply what drifted and delete what is no longer used, writing nothing unless every
    child's name is free of another controller's object (`NameConflict`). The fill Secret comes
    first, so that no pod waits for it, and is created once (`_keep_fill_secret`)."""
    lives = [(manifest, kube.get(manifest["kind"], owner.namespace, manifest["metadata"]["name"]))
             for manifest in (build_fill_secret(owner), *decision.apply)]
    taken = [(manifest, who) for manifest, live in lives
             if (who := foreign_controller(owner, live)) is not None]
    if taken:
        raise NameConflict("; ".join(_held(owner, m, who) for m, who in taken) + (
            "; the operator writes no object it does not control, so this DOD has no "
            "children: rename it (its children are named after it), or delete the other"),
            hint="child names add -peers, -prefill, -settings-<revision>, -fill-group or "
            "-fill-secret to the DOD's name")
    (secret, live_secret), *children = lives
    _keep_fill_secret(kube, owner, secret, live_secret)
    for manifest, live in children:
        meta = manifest["metadata"]
        if live is None or drifted(manifest, live):
            log.info("%s/%s: applying %s %s (%s)", owner.namespace, owner.name,
                     manifest["kind"], meta["name"], "missing" if live is None else "drifted")
            if manifest.get("immutable") and live is not None:
                kube.delete(manifest["kind"], owner.namespace, meta["name"])
            kube.apply(manifest)
    for kind, name in decision.delete:
        if foreign_controller(owner, kube.get(kind, owner.namespace, name)) is not None:
            continue  # another's object of the name: never the operator's to delete
        log.info("%s/%s: deleting %s %s", owner.namespace, owner.name, kind, name)
        kube.delete(kind, owner.namespace, name)


def _keep_fill_secret(kube: KubeClient, owner: Owner, secret: Mapping[str, Any],
                      live: Mapping[str, Any] | None) -> None:
    """Create the fill Secret with new random data when it is missing, or write that data into
    one without any (`dlo render`'s manifest, applied by hand); otherwise only its metadata may
    follow the manifest (a replaced DOD's owner reference): its data is never written again
    (`fill_secret`)."""
    meta = secret["metadata"]
    if live is None:
        log.info("%s/%s: creating Secret %s (new fill secret)", owner.namespace, owner.name,
                 meta["name"])
        kube.create({**secret, **new_data()})
        return
    patch: dict[str, Any] = {}
    if drifted(meta, live.get("metadata")):
        patch["metadata"] = {key: meta[key] for key in ("labels", "ownerReferences")
                             if key in meta}
    if FILL_SECRET_KEY not in (live.get("data") or {}):
        patch.update(new_data())
    if patch:
        kube.merge_patch("Secret", owner.namespace, meta["name"], patch)


def _held(owner: Owner, manifest: Mapping[str, Any], who: str) -> str:
    what = f"{manifest['kind']} {owner.namespace}/{manifest['metadata']['name']}"
    if who == UNCONTROLLED:
        return f"{what} exists and no {KIND} controls it"
    return f"{what} belongs to {who}"


def _write_status(kube: KubeClient, owner: Owner, dod: Mapping[str, Any],
                  previous: Mapping[str, Any], status: dict[str, Any]) -> None:
    status["observedGeneration"] = (dod.get("metadata") or {}).get("generation")
    if any(previous.get(key) != value for key, value in status.items()):
        kube.patch_deployment_status(owner.namespace, owner.name, _merge_patch(previous, status))


def _merge_patch(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, Any]:
    """`after` as a JSON merge patch over `before`: a field of a nested object that `after`
    drops is set to null (a merge patch keeps every field it does not name, so a superseded
    prefill record would keep its `retryAt`). Top-level fields it does not name stay: other
    writers own them (`progress`)."""
    patch = dict(after)
    for key, value in after.items():
        old = before.get(key)
        if isinstance(value, Mapping) and isinstance(old, Mapping):
            patch[key] = {**{gone: None for gone in old if gone not in value},
                          **_merge_patch(old, value)}
    return patch


def _replicas(spec: Mapping[str, Any] | None) -> int:
    value = (spec or {}).get("replicas", 1)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1


def _stamp(now: datetime.datetime) -> str:
    return now.strftime("%Y-%m-%dT%H:%M:%SZ")
