"""The kopf handlers: a few lines each, calling the pure builders and the status aggregation.

- create / update / resume: admit the spec (`admission`: the CRD's verdict, the settings
  validator, the host-path allowlist); if admitted, server-side apply the children (owned by
  the DOD); write the status. A refused spec gets `Valid=False` and a Warning Event, and no
  children (an update to a refused spec leaves the last valid children running). An API error
  gets `Applied=False` and a Warning Event: conflicts, throttling, 5xx and timeouts are retried
  with exponential backoff (`ApplyRetrying`), anything else (`ApplyFailed`) waits for the next
  change of the spec.
- delete: nothing to remove by hand: the children carry owner references, so the garbage
  collector deletes them; node caches stay (the loader's eviction manages them). The handler
  records that in an event, and kopf then removes its finalizer.
- pods: an index of the workload pods per DOD, and a watcher that rewrites the DOD's status
  whenever one of its pods changes, with a Warning Event when a pod falls into trouble.

Handlers are registered on `registry`, which `dlo operator run` and the tests pass to kopf.
They must not build manifests or decide phases themselves.
"""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Iterable, Mapping
from typing import Any

import kopf

from dlo_operator.admission import admit
from dlo_operator.conditions import FALSE, Condition, find, report_event
from dlo_operator.errors import KubeError, KubeTransientError, SpecError
from dlo_operator.host_paths import DEFAULT_ALLOWED_HOST_PATHS
from dlo_operator.kube import KubeClient, backoff_delay
from dlo_operator.manifests import build_children
from dlo_operator.naming import GROUP, LABEL_DEPLOYMENT, PLURAL, VERSION, Owner
from dlo_operator.spec import DEFAULT_LOADER_IMAGE
from dlo_operator.status import (
    APPLIED,
    APPLY_RETRYING,
    READY,
    TROUBLE_REASONS,
    VALID,
    status_from_pods,
)

registry = kopf.OperatorRegistry()
DOD = (GROUP, VERSION, PLURAL)


@kopf.on.startup(registry=registry)
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Keep kopf's bookkeeping in our own annotations; no CRD or namespace scanning (the RBAC
    grants neither); one replica, so no peering."""
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    settings.scanning.disabled = True
    settings.peering.standalone = True
    memo.kube = KubeClient.from_environment()
    memo.reported = {}
    memo.reports_lock = threading.Lock()


@kopf.on.login(registry=registry)
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """kopf authenticates exactly as `kube` does: in-cluster service account, else kubeconfig."""
    return kopf.login_via_client(**kwargs)


@kopf.on.cleanup(registry=registry)
def close(memo: kopf.Memo, **_: Any) -> None:
    memo.kube.close()


@kopf.index("pods", labels={LABEL_DEPLOYMENT: kopf.PRESENT}, registry=registry)
def workload_pods(namespace: str, labels: Mapping[str, str], body: kopf.Body,
                  **_: Any) -> dict[tuple[str, str], dict[str, Any]]:
    return {(namespace, labels[LABEL_DEPLOYMENT]): _plain(body)}


@kopf.on.create(*DOD, registry=registry)
def on_create(**kwargs: Any) -> None:
    _reconcile(**kwargs)


@kopf.on.update(*DOD, registry=registry)
def on_update(**kwargs: Any) -> None:
    _reconcile(**kwargs)


@kopf.on.resume(*DOD, registry=registry)
def on_resume(**kwargs: Any) -> None:
    _reconcile(**kwargs)


@kopf.on.delete(*DOD, registry=registry)
def on_delete(body: kopf.Body, name: str, **_: Any) -> None:
    kopf.info(body, reason="Deleted", message=(
        f"children of {name} are left to the garbage collector (owner references); "
        "node caches stay until the loader's eviction reclaims them"))


@kopf.on.event("pods", labels={LABEL_DEPLOYMENT: kopf.PRESENT}, registry=registry)
def on_pod_event(namespace: str, labels: Mapping[str, str], memo: kopf.Memo,
                 workload_pods: kopf.Index, logger: logging.Logger, **_: Any) -> None:
    name = labels[LABEL_DEPLOYMENT]
    try:
        dod = memo.kube.get_deployment(namespace, name)
        if dod is None or dod["metadata"].get("deletionTimestamp"):
            return
        previous = dod.get("status") or {}
        status = status_from_pods(
            list(workload_pods.get((namespace, name), ())),
            replicas=_replicas(dod.get("spec")), previous=previous, now=_now(),
            generation=previous.get("observedGeneration"),
            problems=_carried_problems(previous))
        if any(previous.get(key) != value for key, value in status.items()):
            memo.kube.patch_deployment_status(namespace, name, status)
        trouble = find(status, READY)
        if trouble is not None and trouble.reason in TROUBLE_REASONS and _first_report(
                memo, (namespace, name), trouble.message):
            report_event(dod, trouble)
    except KubeError as exc:
        logger.error("cannot update the status of %s/%s: %s", namespace, name, exc)
    except KubeTransientError as exc:
        logger.warning("status of %s/%s not updated, next pod event retries: %s",
                       namespace, name, exc)


def _reconcile(*, body: kopf.Body, name: str, namespace: str, meta: kopf.Meta,
               patch: kopf.Patch, memo: kopf.Memo, workload_pods: kopf.Index, retry: int,
               logger: logging.Logger, **_: Any) -> None:
    """Admit the spec, apply the children, write the status. Every failure becomes a condition
    and a Warning Event; an API error worth retrying is retried with backoff, any other waits
    for the next change of the spec."""
    generation = meta.get("generation")
    retry_in: float | None = None
    try:
        deployment = admit(body, allowed_host_paths=_allowed_host_paths(memo),
                           loader_image=memo.get("loader_image") or DEFAULT_LOADER_IMAGE)
    except SpecError as exc:
        logger.error("spec refused, nothing applied: %s", exc)
        problem: Condition | None = Condition(VALID, FALSE, "SpecInvalid", str(exc))
        replicas = _replicas(body.get("spec"))
    else:
        replicas = deployment.replicas
        problem, retry_in = _apply(memo.kube, build_children(Owner.from_body(body), deployment),
                                   retry)
    pods = list(workload_pods.get((namespace, name), ()))
    status = status_from_pods(pods, replicas=replicas, previous=body.get("status") or {},
                              now=_now(), generation=generation,
                              problems=[problem] if problem else [])
    patch["status"] = {**status, "observedGeneration": generation}
    if problem is not None:
        report_event(body, problem)
    if retry_in is not None:
        raise kopf.TemporaryError(problem.message if problem else "", delay=retry_in)


def _apply(kube: KubeClient, children: list[dict[str, Any]],
           retry: int) -> tuple[Condition | None, float | None]:
    """Apply every child in order. The failure, if any, as an `Applied=False` condition, and
    the delay before the next attempt when the API error is worth retrying."""
    try:
        for child in children:
            kube.apply(child)
    except KubeTransientError as exc:
        delay = backoff_delay(retry, exc.delay_s)
        return Condition(APPLIED, FALSE, APPLY_RETRYING,
                         f"{exc}; attempt {retry + 2} in {delay:.0f} s"), delay
    except KubeError as exc:
        return Condition(APPLIED, FALSE, "ApplyFailed",
                         f"{exc}; retried when the spec changes ({exc.hint})"), None
    return None, None


def _allowed_host_paths(memo: kopf.Memo) -> tuple[str, ...]:
    return tuple(memo.get("allowed_host_paths") or DEFAULT_ALLOWED_HOST_PATHS)


def _replicas(spec: Mapping[str, Any] | None) -> int:
    value = (spec or {}).get("replicas", 1)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1


def _first_report(memo: kopf.Memo, key: tuple[str, str], message: str) -> bool:
    """True once per new trouble of a DOD (pod events of several pods arrive concurrently)."""
    with memo.reports_lock:
        if memo.reported.get(key) == message:
            return False
        memo.reported[key] = message
        return True


def _carried_problems(status: Mapping[str, Any]) -> list[Condition]:
    """A refused spec or apply stays reported until the next reconcile of the DOD."""
    found = (find(status, VALID), find(status, APPLIED))
    return [condition for condition in found if condition is not None and condition.failed]


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _plain(value: Any) -> Any:
    """A deep plain copy of kopf's read-only views, safe to keep in the index."""
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        return [_plain(item) for item in value]
    return value
