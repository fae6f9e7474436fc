"""The kopf handlers: a few lines each, calling the pure builders and the status aggregation.

- create / update / resume: parse and validate the spec; if valid, server-side apply the
  ConfigMap, headless Service and StatefulSet (owned by the DOD); write the status.
  An invalid spec gets `Valid=False` with the validator's message and no children (an update
  to an invalid spec leaves the last valid children running).
- delete: nothing to remove by hand: the children carry owner references, so the garbage
  collector deletes them; node caches stay (the loader's eviction manages them). The handler
  records that in an event, and kopf then removes its finalizer.
- pods: an index of the workload pods per DOD, and a watcher that rewrites the DOD's status
  whenever one of its pods changes.

Handlers are registered on `registry`, which `dlo operator run` and the tests pass to kopf.
They must not build manifests or decide phases themselves.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import kopf

from dlo_operator import metrics, progress
from dlo_operator.errors import KubeError, KubeTransientError, SpecError
from dlo_operator.kube import KubeClient
from dlo_operator.manifests import build_children
from dlo_operator.naming import GROUP, LABEL_DEPLOYMENT, PLURAL, VERSION, Owner
from dlo_operator.spec import parse_spec
from dlo_operator.status import status_from_pods

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
def on_delete(body: kopf.Body, name: str, namespace: str, **_: Any) -> None:
    metrics.DEPLOYMENTS.set_phase(namespace, name, None)  # metrics: a deleted DOD has no phase
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
            invalid_message=_invalid_message(previous))
        if any(previous.get(key) != value for key, value in status.items()):
            memo.kube.patch_deployment_status(namespace, name, status)
        metrics.record_status(namespace, name, status, previous)  # metrics: phase, fills
    except KubeError as exc:
        logger.error("cannot update the status of %s/%s: %s", namespace, name, exc)
    except KubeTransientError as exc:
        logger.warning("status of %s/%s not updated, next pod event retries: %s",
                       namespace, name, exc)


def _reconcile(*, body: kopf.Body, spec: kopf.Spec, name: str, namespace: str, meta: kopf.Meta,
               patch: kopf.Patch, memo: kopf.Memo, workload_pods: kopf.Index,
               logger: logging.Logger, **_: Any) -> None:
    """Validate, apply the children, write the status; API errors go back to kopf's retries."""
    pods = list(workload_pods.get((namespace, name), ()))
    previous = body.get("status") or {}
    try:
        deployment = parse_spec(spec)
    except SpecError as exc:
        logger.error("invalid spec, nothing created: %s", exc)
        status = status_from_pods(pods, replicas=_replicas(spec), previous=previous, now=_now(),
                                  invalid_message=str(exc))
        patch["status"] = {**status, "observedGeneration": meta.get("generation")}
        metrics.RECONCILES.labels(outcome="invalid").inc()  # metrics: reconcile outcome
        metrics.record_status(namespace, name, status, previous)
        return
    try:
        for child in build_children(Owner.from_body(body), deployment):
            memo.kube.apply(child)
    except KubeTransientError as exc:
        metrics.RECONCILES.labels(outcome="retried").inc()  # metrics: reconcile outcome
        raise kopf.TemporaryError(str(exc), delay=exc.delay_s) from exc
    except KubeError as exc:
        metrics.RECONCILES.labels(outcome="failed").inc()  # metrics: reconcile outcome
        raise kopf.PermanentError(str(exc)) from exc
    status = status_from_pods(pods, replicas=deployment.replicas, previous=previous, now=_now())
    patch["status"] = {**status, "observedGeneration": meta.get("generation")}
    metrics.RECONCILES.labels(outcome="applied").inc()  # metrics: reconcile outcome
    metrics.record_status(namespace, name, status, previous)


@kopf.timer(*DOD, interval=progress.INTERVAL_S, registry=registry)
def loader_progress(spec: kopf.Spec, name: str, namespace: str, status: kopf.Status,
                    memo: kopf.Memo, workload_pods: kopf.Index, logger: logging.Logger,
                    **_: Any) -> None:
    """Live progress: while loaders run, read their metrics endpoints into `status.progress`;
    remove it once none runs (the fill summaries in `status.nodes` hold the final figures)."""
    try:
        port = parse_spec(spec).settings.loader.metrics_port
    except SpecError:
        return
    pods = progress.running_loaders(list(workload_pods.get((namespace, name), ())))
    current = progress.progress_status(progress.read_all(pods, port) if port else [])
    if current == status.get("progress"):
        return
    try:
        memo.kube.patch_deployment_status(namespace, name, {"progress": current})
    except (KubeError, KubeTransientError) as exc:
        logger.warning("progress of %s/%s not written, the next tick retries: %s",
                       namespace, name, exc)


def _replicas(spec: Mapping[str, Any] | None) -> int:
    value = (spec or {}).get("replicas", 1)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1


def _invalid_message(status: Mapping[str, Any]) -> str | None:
    """A spec the last reconcile found invalid stays invalid until the next reconcile."""
    for condition in status.get("conditions") or ():
        if condition.get("type") == "Valid" and condition.get("status") == "False":
            return str(condition.get("message", ""))
    return None


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _plain(value: Any) -> Any:
    """A deep plain copy of kopf's read-only views, safe to keep in the index."""
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        return [_plain(item) for item in value]
    return value
