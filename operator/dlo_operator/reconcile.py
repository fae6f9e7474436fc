"""`reconcile`: read what one DOD owns, let `rollout.decide` say what should be, make it so.

One path for every trigger (the DOD changed, one of its pods or children changed, the periodic
timer): observe the children and pods, decide, apply only the children that drifted from their
manifests (comparing just the fields this operator sets, so fields other controllers own are
never fought over), delete what is no longer used, post the Events, and write the status.
Called by `handlers` under a per-DOD lock; the only caller of `rollout` and `report`.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dlo_contract.fill_group import FILL_GROUP_KEY, FillGroup
from dlo_operator.errors import SpecError
from dlo_operator.kube import KubeClient
from dlo_operator.naming import LABEL_DEPLOYMENT, LABEL_ROLE, Owner, selector_labels
from dlo_operator.report import post_event, set_condition
from dlo_operator.rollout import BackoffConfig, Decision, Observed, PrefillState, Stage, decide
from dlo_operator.spec import parse_spec
from dlo_operator.status import status_from_pods

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ReconcileConfig:
    backoff: BackoffConfig = BackoffConfig()


def reconcile(kube: KubeClient, dod: Mapping[str, Any], config: ReconcileConfig) -> Decision | None:
    """One step for `dod`; returns the decision (None for an invalid spec)."""
    owner = Owner.from_body(dod)
    now = datetime.datetime.now(datetime.timezone.utc)
    previous = dict(dod.get("status") or {})
    pods = kube.list("Pod", owner.namespace, {LABEL_DEPLOYMENT: owner.name})
    workload = [p for p in pods if LABEL_ROLE not in _labels(p)]
    try:
        spec = parse_spec(dod.get("spec"))
    except SpecError as exc:
        log.error("%s/%s: invalid spec, children left as they are: %s", owner.namespace,
                  owner.name, exc)
        status = status_from_pods(workload, replicas=_replicas(dod.get("spec")),
                                  previous=previous, now=_stamp(now), invalid_message=str(exc))
        _write_status(kube, owner, dod, previous, status)
        return None
    seen = _observe(kube, owner, pods, workload, previous, now)
    decision = decide(owner, spec, seen, config.backoff)
    _converge(kube, owner, decision)
    for report in decision.reports:
        post_event(dod, report)
    status = status_from_pods(workload, replicas=spec.replicas, previous=previous,
                              now=_stamp(now))
    status.update(_rollout_status(owner, decision, status, previous, _stamp(now)))
    _write_status(kube, owner, dod, previous, status)
    return decision


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
    return Observed(
        statefulset=kube.get("StatefulSet", owner.namespace, owner.statefulset_name),
        pods=workload, group=group,
        jobs=kube.list("Job", owner.namespace, {**mine, LABEL_ROLE: "prefill"}),
        job_pods=[p for p in pods if _labels(p).get(LABEL_ROLE) == "prefill"],
        settings_configmaps=kube.list("ConfigMap", owner.namespace,
                                      {**mine, LABEL_ROLE: "settings"}),
        prefill=previous.get("prefill") or {}, now=now)


def _converge(kube: KubeClient, owner: Owner, decision: Decision) -> None:
    for manifest in decision.apply:
        meta = manifest["metadata"]
        live = kube.get(manifest["kind"], owner.namespace, meta["name"])
        if live is None or drifted(manifest, live):
            log.info("%s/%s: applying %s %s (%s)", owner.namespace, owner.name,
                     manifest["kind"], meta["name"], "missing" if live is None else "drifted")
            if manifest.get("immutable") and live is not None:
                kube.delete(manifest["kind"], owner.namespace, meta["name"])
            kube.apply(manifest)
    for kind, name in decision.delete:
        log.info("%s/%s: deleting %s %s", owner.namespace, owner.name, kind, name)
        kube.delete(kind, owner.namespace, name)


def drifted(desired: Any, live: Any) -> bool:
    """True when a field `desired` sets differs in `live`. Fields only `live` has (defaults,
    other controllers' fields, status) are not drift."""
    if isinstance(desired, Mapping):
        return not isinstance(live, Mapping) or any(
            drifted(value, live.get(key)) for key, value in desired.items())
    if isinstance(desired, list):
        return not isinstance(live, list) or len(desired) != len(live) or any(
            drifted(d, v) for d, v in zip(desired, live))
    return desired != live


def _rollout_status(owner: Owner, decision: Decision, status: Mapping[str, Any],
                    previous: Mapping[str, Any], now: str) -> dict[str, Any]:
    """The lifecycle fields: stage, revision, prefill record, `Prefilled` condition, selector
    (for the scale subresource)."""
    prefill = decision.prefill
    state = prefill.get("state")
    if not prefill:
        prefilled = ("True", "NotNeeded", "no prefill has been needed")
    elif state == PrefillState.FAILED.value:
        prefilled = ("False", "PrefillFailed", decision.message)
    elif state == PrefillState.RUNNING.value:
        prefilled = ("False", "Prefilling", decision.message)
    else:
        prefilled = ("True", "PrefillSucceeded", str(prefill.get("message", "")))
    conditions = set_condition(status["conditions"], type="Prefilled", status=prefilled[0],
                               reason=prefilled[1], message=prefilled[2], now=now)
    old = {c.get("type"): c for c in previous.get("conditions") or ()}
    if "Prefilled" in old and old["Prefilled"].get("status") == prefilled[0]:
        conditions[-1]["lastTransitionTime"] = old["Prefilled"].get("lastTransitionTime", now)
    fields: dict[str, Any] = {
        "stage": decision.stage.value, "stageMessage": decision.message,
        "revision": decision.revision,
        "conditions": conditions,
        "selector": ",".join(f"{k}={v}" for k, v in selector_labels(owner).items()),
    }
    if decision.stage in (Stage.PREFILLING, Stage.BACKOFF):
        fields["phase"] = "Updating" if status["phase"] == "Ready" else status["phase"]
    fields["prefill"] = prefill or None
    return fields


def _write_status(kube: KubeClient, owner: Owner, dod: Mapping[str, Any],
                  previous: Mapping[str, Any], status: dict[str, Any]) -> None:
    status["observedGeneration"] = (dod.get("metadata") or {}).get("generation")
    if any(previous.get(key) != value for key, value in status.items()):
        kube.patch_deployment_status(owner.namespace, owner.name, status)


def _labels(obj: Mapping[str, Any]) -> Mapping[str, str]:
    return (obj.get("metadata") or {}).get("labels") or {}


def _replicas(spec: Mapping[str, Any] | None) -> int:
    value = (spec or {}).get("replicas", 1)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1


def _stamp(now: datetime.datetime) -> str:
    return now.strftime("%Y-%m-%dT%H:%M:%SZ")
