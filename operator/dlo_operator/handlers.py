"""The kopf handlers: a few lines each, all ending in one `reconcile` of the DOD concerned.

- create / update / resume of a DOD, any event of its pods (workload and prefill) or of its
  children (StatefulSet, ConfigMaps, Services, Jobs: a deleted or edited child is restored within
  seconds), and a periodic timer (prefill and apply retries after their backoff, and a safety
  net) all run `reconcile.reconcile` under a per-DOD lock, so two triggers never interleave their
  writes. `reconcile` admits the spec (`admission`), applies what drifted, writes the status and
  posts the Events (`Valid=False`, `Applied=False`, pod troubles, prefill milestones).
- delete: nothing to remove by hand: the children carry owner references, so the garbage
  collector deletes them; node caches stay (the loader's eviction manages them). The handler
  records that in an event, and kopf then removes its finalizer once the DOD's timers have
  stopped (a timer run in flight is waited for, `TIMER_EXIT_WAIT_S`, not kopf's minute).

- node-cache claims and volumes: `provisioner` serves each claim of the node-cache StorageClass
  with its volume once the scheduler chose the node, and deletes a volume whose claim is gone.

Handlers are registered on `registry`, which `dlo operator run` and the tests pass to kopf.
They must not build manifests or decide phases themselves.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import contextvars
import functools
import logging
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

import kopf

from dlo_operator import fill_report, metrics, progress, provisioner
from dlo_operator.conditions import post_event
from dlo_operator.errors import KubeError, KubeTransientError, SpecError
from dlo_operator.installation import InstallationConfig
from dlo_operator.kube import KubeClient
from dlo_contract.fill_proof import summary_proof
from dlo_contract.names import FILL_SECRET_KEY
from dlo_operator.naming import (
    ANNOTATION_FILL_SUMMARY,
    GROUP,
    LABEL_DEPLOYMENT,
    PLURAL,
    VERSION,
    fill_secret_name,
)
from dlo_operator.node_cache import LABEL_NODE_CACHE, NODE_CACHE_CLASS, NodeCacheConfig
from dlo_operator.reconcile import ReconcileConfig, reconcile, utc_now
from dlo_operator.prefill_record import format_time
from dlo_operator.prefill_stage import BackoffConfig
from dlo_operator.spec import parse_spec

registry = kopf.OperatorRegistry()
DOD = (GROUP, VERSION, PLURAL)
RESYNC_INTERVAL_S = 2.0
"""How often every DOD is reconciled even without an event (prefill retries, lost events)."""
PREFILL_BACKOFF_ENV = "DLO_OPERATOR_PREFILL_BACKOFF_SECONDS"
"""First delay before retrying a failed prefill (doubling up to 600 s); default 10."""
TIMER_EXIT_WAIT_S = 5.0
"""How long a DOD's deletion waits for a timer run in flight before checking again each second."""
PROGRESS_WORKERS = 16
"""Threads that read the loaders' progress, all DODs together, apart from kopf's own pool."""
PROGRESS_PER_NAMESPACE = 2
"""The most progress reads of one namespace's DODs under way at once (the rest wait without a
thread), so one tenant's slow pods hold at most this many of `PROGRESS_WORKERS`."""
_OWNED = ("statefulsets", "configmaps", "services", "jobs", "poddisruptionbudgets")


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
    # A deleted DOD keeps kopf's finalizer until its timers stop; a timer caught mid-run (a
    # reconcile, the progress reads of up to `progress.READ_DEADLINE_S`) finishes first.
    # kopf's default re-checks a minute later; wait for the run instead, then check each second.
    settings.background.instant_exit_timeout = TIMER_EXIT_WAIT_S
    settings.background.cancellation_polling = 1.0
    memo.kube = KubeClient.from_environment()
    memo.locks = {}
    memo.pending = set()
    memo.locks_guard = threading.Lock()
    memo.retries = {}
    memo.config = ReconcileConfig(
        backoff=BackoffConfig(base_s=float(os.environ.get(PREFILL_BACKOFF_ENV) or 10.0)),
        installation=memo.get("installation") or InstallationConfig(),
        clock=memo.get("clock") or utc_now)
    memo.node_cache = NodeCacheConfig(root=memo.config.installation.node_cache_root)
    memo.progress_pool = concurrent.futures.ThreadPoolExecutor(
        max_workers=PROGRESS_WORKERS, thread_name_prefix="dlo-progress")
    memo.progress_gates = {}
    memo.progress_stopped = threading.Event()


@kopf.on.login(registry=registry)
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """kopf authenticates exactly as `kube` does: in-cluster service account, else kubeconfig."""
    return kopf.login_via_client(**kwargs)


@kopf.on.cleanup(registry=registry)
def close(memo: kopf.Memo, **_: Any) -> None:
    memo.progress_stopped.set()
    memo.progress_pool.shutdown(wait=False, cancel_futures=True)
    memo.kube.close()


@kopf.on.create(*DOD, registry=registry)
@kopf.on.update(*DOD, registry=registry)
@kopf.on.resume(*DOD, registry=registry)
def on_change(namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    try:
        _reconcile(memo, namespace, name)
    except KubeTransientError as exc:
        raise kopf.TemporaryError(str(exc), delay=exc.delay_s) from exc
    except KubeError as exc:
        raise kopf.PermanentError(str(exc)) from exc


@kopf.timer(*DOD, interval=RESYNC_INTERVAL_S, registry=registry)
def on_timer(namespace: str, name: str, memo: kopf.Memo, logger: logging.Logger,
             **_: Any) -> None:
    _quietly(memo, namespace, name, logger)


@kopf.on.delete(*DOD, registry=registry)
def on_delete(body: kopf.Body, name: str, namespace: str, **_: Any) -> None:
    metrics.DEPLOYMENTS.set_phase(namespace, name, None)  # metrics: a deleted DOD has no phase
    kopf.info(body, reason="Deleted", message=(
        f"children of {name} are left to the garbage collector (owner references); "
        "node caches stay until the loader's eviction reclaims them"))


@kopf.on.event("pods", labels={LABEL_DEPLOYMENT: kopf.PRESENT}, registry=registry)
def on_pod_event(namespace: str, labels: Mapping[str, str], memo: kopf.Memo,
                 logger: logging.Logger, **_: Any) -> None:
    _quietly(memo, namespace, labels[LABEL_DEPLOYMENT], logger)


for _plural in _OWNED:
    @kopf.on.event(_plural, labels={LABEL_DEPLOYMENT: kopf.PRESENT}, registry=registry)
    def on_child_event(namespace: str, labels: Mapping[str, str], memo: kopf.Memo,
                       logger: logging.Logger, **_: Any) -> None:
        _quietly(memo, namespace, labels[LABEL_DEPLOYMENT], logger)


@kopf.on.event("persistentvolumeclaims", field="spec.storageClassName", value=NODE_CACHE_CLASS,
                registry=registry)
def on_cache_claim(type: str, body: kopf.Body, namespace: str, name: str, memo: kopf.Memo,
                   **_: Any) -> None:
    step = (functools.partial(provisioner.release_claim, memo.kube, body) if type == "DELETED"
            else functools.partial(provisioner.serve_claim, memo.kube, body, memo.node_cache))
    provisioner.with_retries(step, f"claim {namespace}/{name}", time.sleep)


@kopf.on.event("persistentvolumes", labels={LABEL_NODE_CACHE: kopf.PRESENT}, registry=registry)
def on_cache_volume(type: str, body: kopf.Body, name: str, memo: kopf.Memo, **_: Any) -> None:
    if type != "DELETED":
        provisioner.with_retries(functools.partial(provisioner.reclaim_volume, memo.kube, body),
                                 f"volume {name}", time.sleep)


def _keep_summaries(memo: kopf.Memo, body: kopf.Body, pods: Any, port: int,
                    logger: logging.Logger) -> None:
    """Copy each published sidecar loader's fill summary onto its pod, where the status reads it
    (the pod event that follows reconciles); Events say where one finished without members of
    its group, or refilled from peers (`fill_report`). The summaries are asked for with proof of
    the DOD's fill secret; none is read before its Secret exists."""
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    proof = _summary_proof(memo, namespace, name, logger) if pods else None
    if proof is None:
        return
    for pod, line in progress.read_summaries(pods, port, proof):
        pod_name = pod["metadata"]["name"]
        try:
            memo.kube.annotate_pod(namespace, pod_name, {ANNOTATION_FILL_SUMMARY: line})
        except (KubeError, KubeTransientError) as exc:
            logger.warning("fill summary of pod %s/%s not kept, the next tick retries: %s",
                           namespace, pod_name, exc)
            continue
        for report in fill_report.summary_events(pod, line):
            post_event(body, report)


def _summary_proof(memo: kopf.Memo, namespace: str, name: str,
                   logger: logging.Logger) -> str | None:
    """The proof (`fill_proof.summary_proof`) of the DOD's fill secret, from its Secret; None
    while it is absent or unreadable (never a word of its data in the log)."""
    secret_name = fill_secret_name(name)
    try:
        secret = memo.kube.get("Secret", namespace, secret_name)
        value = base64.b64decode(((secret or {}).get("data") or {}).get(FILL_SECRET_KEY) or "",
                                 validate=True)
    except (KubeError, KubeTransientError, binascii.Error, ValueError) as exc:
        logger.warning("fill summaries of %s/%s not read: Secret %s: %s", namespace, name,
                       secret_name, type(exc).__name__ if isinstance(exc, ValueError) else exc)
        return None
    return summary_proof(value.strip()) if value.strip() else None


def _quietly(memo: kopf.Memo, namespace: str, name: str, logger: logging.Logger) -> None:
    """Reconcile from a watch event or the timer: errors are logged, the next event retries."""
    try:
        _reconcile(memo, namespace, name)
    except KubeError as exc:
        logger.error("cannot reconcile %s/%s: %s", namespace, name, exc)
    except KubeTransientError as exc:
        logger.warning("%s/%s not reconciled, the next event retries: %s", namespace, name, exc)


def _reconcile(memo: kopf.Memo, namespace: str, name: str) -> None:
    """At most one reconcile runs and one waits per DOD: a trigger arriving while one waits
    is covered by it (it reads the cluster after the trigger), so bursts of pod events never
    pile up threads."""
    key = (namespace, name)
    with memo.locks_guard:
        lock = memo.locks.setdefault(key, threading.Lock())
        if key in memo.pending:
            return
        memo.pending.add(key)
    with lock:
        with memo.locks_guard:
            memo.pending.discard(key)
        dod = memo.kube.get_deployment(namespace, name)
        if dod is None or (dod.get("metadata") or {}).get("deletionTimestamp"):
            return
        reconcile(memo.kube, dod, memo.config, memo.retries)


@kopf.timer(*DOD, interval=progress.INTERVAL_S, registry=registry)
async def loader_progress(spec: kopf.Spec, name: str, namespace: str, status: kopf.Status,
                          body: kopf.Body, memo: kopf.Memo, logger: logging.Logger,
                          **_: Any) -> None:
    """Live progress: while loaders fill (the pods' or a prefill's), read their metrics
    endpoints into `status.progress`; remove it once none fills (the fill summaries in
    `status.nodes` hold the final figures). A pod's sidecar loader that published has its
    summary copied onto its pod first, once.

    The reads go to pods a tenant runs (see [Note: reading a tenant's pod] in `progress`), so
    they run on the operator's own progress threads, never on kopf's pool, which every
    reconcile needs; and at most `PROGRESS_PER_NAMESPACE` DODs of one namespace at once, the
    others waiting here without a thread, so one tenant's slow pods delay no one else's."""
    gate = memo.progress_gates.setdefault(namespace, asyncio.Semaphore(PROGRESS_PER_NAMESPACE))
    tick = functools.partial(_read_progress, spec, name, namespace, status, body, memo, logger)
    async with gate:
        # In a copy of the handler's context, as kopf runs its own sync handlers: the Events
        # the tick posts find kopf's settings there.
        try:
            await asyncio.get_running_loop().run_in_executor(
                memo.progress_pool, contextvars.copy_context().run, tick)
        except RuntimeError:  # the pool is shut down: the operator is stopping
            if not memo.progress_stopped.is_set():
                raise


def _read_progress(spec: kopf.Spec, name: str, namespace: str, status: kopf.Status,
                   body: kopf.Body, memo: kopf.Memo, logger: logging.Logger) -> None:
    """One tick of `loader_progress`, on a progress thread."""
    try:
        port = parse_spec(spec).settings.loader.metrics_port
    except SpecError:
        return
    try:
        every = memo.kube.list("Pod", namespace, {LABEL_DEPLOYMENT: name})
    except (KubeError, KubeTransientError) as exc:
        logger.warning("progress of %s/%s not read, the next tick retries: %s",
                       namespace, name, exc)
        return
    if port:
        _keep_summaries(memo, body, progress.published_without_summary(every), port, logger)
    pods = progress.running_loaders(every)
    current = progress.progress_status(
        progress.read_all(pods, port) if port else [], previous=status.get("progress"),
        now=format_time(memo.config.clock()), running=pods)
    if current == status.get("progress"):
        return
    try:
        memo.kube.patch_deployment_status(namespace, name, {"progress": current})
    except (KubeError, KubeTransientError) as exc:
        logger.warning("progress of %s/%s not written, the next tick retries: %s",
                       namespace, name, exc)
