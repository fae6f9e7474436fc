"""Harness of the operator tests: a Kubernetes API emulator (KMock) and the operator under
kopf's `KopfRunner`, plus helpers that play the StatefulSet controller and the kubelet.

KMock gaps filled here, so that the emulator behaves like an API server where the operator
relies on it: it assigns no uid, resourceVersion, generation or creationTimestamp (filled on
create; resourceVersion and generation bumped on change), and a server-side apply of a missing
object is a 404 there but a create on a real server. It has no selectors, no schema defaulting
or pruning and no garbage collector; the operator is run cluster-wide (`-A`) because KMock cannot
serve the namespace list.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import dataclasses
import datetime
import gc
import itertools
import json
import threading
import uuid
import warnings
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import kmock
import kmock._internal.dsl as kmock_dsl
import kopf
import kubernetes.config.kube_config
import pytest
import pytest_asyncio
from kopf.testing import KopfRunner

from dlo_operator import handlers
from dlo_operator.naming import GROUP, KIND, LABEL_DEPLOYMENT, LABEL_POD_INDEX, PLURAL, VERSION

NAMESPACE = "inference"
DOD_RESOURCE = f"{GROUP}/{VERSION}/{PLURAL}"
DOD_PATH = f"/apis/{GROUP}/{VERSION}/namespaces/{NAMESPACE}/{PLURAL}"
PODS_PATH = f"/api/v1/namespaces/{NAMESPACE}/pods"
_APPLY = "application/apply-patch+yaml"
TEST_USER_AGENT = "dlo-tests"
"""Marks the tests' own requests (playing the user, the kubelet, the StatefulSet controller)."""


def _member_of_chain(view: Any, request: Any) -> bool:
    """Whether `request` is in a filter or priority view: in its source, then (for a filter)
    past its criteria, evaluated in the order its requests would be. KMock answers this by
    filtering the whole request history again, for every reaction, on every request: quadratic
    over a test (a test that makes 500 requests spent most of its time there). Slices and the
    other views keep KMock's own answer."""
    if not isinstance(request, kmock.Request):
        return _KMOCK_CONTAINS(view, request)
    if request not in view._source:
        return False
    return not isinstance(view, _KMOCK_FILTER) or bool(view.criteria(request))


def _member_of_root(view: Any, request: Any) -> bool:
    if not isinstance(request, kmock.Request):
        return _KMOCK_CONTAINS(view, request)
    return any(seen is request for seen in reversed(view._requests))


_KMOCK_CONTAINS = kmock_dsl.View.__contains__
_KMOCK_FILTER = kmock_dsl.Filter
for _view, _contains in ((kmock_dsl.Filter, _member_of_chain),
                         (kmock_dsl.Priority, _member_of_chain), (kmock_dsl.Root, _member_of_root)):
    assert "__contains__" not in vars(_view), f"kmock {_view.__name__} answers membership itself"
    _view.__contains__ = _contains


class ClusterEmulator(kmock.KubernetesEmulator):
    """KMock's emulator plus the object metadata and server-side-apply create of a real server."""

    _versions = itertools.count(1)

    async def _handle(self, request: kmock.Request) -> Any:
        if request.resource is not None and isinstance(request.data, dict):
            if request.action == kmock.action.CREATE:
                self._fill_new(request)
            elif request.action == kmock.action.UPDATE and request.name is not None:
                await self._prepare_update(request)
        return await super()._handle(request)

    def _fill_new(self, request: kmock.Request) -> None:
        meta = request.data.setdefault("metadata", {})
        meta.setdefault("namespace", request.namespace)
        if not meta.get("name") and meta.get("generateName"):  # kopf's Events
            meta["name"] = f"{meta['generateName']}{uuid.uuid4().hex[:5]}"
        meta["uid"] = str(uuid.uuid4())
        meta["resourceVersion"] = str(next(self._versions))
        meta["generation"] = 1
        meta["creationTimestamp"] = datetime.datetime.now(datetime.timezone.utc).strftime(
            "%Y-%m-%dT%H:%M:%SZ")

    async def _prepare_update(self, request: kmock.Request) -> None:
        key = (request.resource, request.namespace, request.name)
        exists = key in self._objects and not self._objects[key].deleted
        if not exists and request.headers.get("Content-Type", "").startswith(_APPLY):
            self._fill_new(request)
            async with self._lock:
                self._objects[key] = copy.deepcopy(request.data)
                raw = self._objects[key].raw
                await self._buses[request.resource].put({"type": "ADDED", "object": raw})
            return
        if not exists:
            return
        meta = request.data.setdefault("metadata", {})
        meta["resourceVersion"] = str(next(self._versions))
        current = self._objects[key].raw
        if request.subresource is None and "spec" in request.data and merge_patch(
                current.get("spec"), request.data["spec"]) != current.get("spec"):
            meta["generation"] = int(current["metadata"].get("generation", 1)) + 1


def merge_patch(base: Any, patch: Any) -> Any:
    """`patch` applied to `base` as a JSON merge patch (a None removes the field)."""
    if not isinstance(base, dict) or not isinstance(patch, dict):
        return patch
    out = dict(base)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(base.get(key), value)
    return out


@pytest_asyncio.fixture()
async def cluster(tmp_path: Path,
                  monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[ClusterEmulator]:
    """A running emulator with the DOD and pod resources declared, and a kubeconfig for it."""
    async with ClusterEmulator() as emulator, kmock.Server(emulator):
        emulator.resources[DOD_RESOURCE] = kmock.ResourceInfo(
            kind=KIND, singular="diffusionoffloaddeployment", namespaced=True,
            shortnames={"dod"}, subresources={"status"},
            verbs={"get", "list", "watch", "create", "patch", "delete"})
        emulator.resources["v1/pods"] = kmock.ResourceInfo(
            kind="Pod", singular="pod", namespaced=True, subresources={"status"},
            verbs={"get", "list", "watch", "create", "patch", "delete"})
        for resource, kind in (("v1/configmaps", "ConfigMap"), ("v1/services", "Service"),
                               ("apps/v1/statefulsets", "StatefulSet"), ("batch/v1/jobs", "Job"),
                               ("policy/v1/poddisruptionbudgets", "PodDisruptionBudget"),
                               ("v1/secrets", "Secret"),
                               ("networking.k8s.io/v1/networkpolicies", "NetworkPolicy")):
            emulator.resources[resource] = kmock.ResourceInfo(
                kind=kind, singular=kind.lower(), namespaced=True, subresources={"status"},
                verbs={"get", "list", "watch", "create", "patch", "delete"})
        emulator.resources["v1/persistentvolumeclaims"] = kmock.ResourceInfo(
            kind="PersistentVolumeClaim", singular="persistentvolumeclaim", namespaced=True,
            subresources={"status"}, verbs={"get", "list", "watch", "create", "patch", "delete"})
        for resource, kind in (("v1/persistentvolumes", "PersistentVolume"), ("v1/nodes", "Node")):
            emulator.resources[resource] = kmock.ResourceInfo(
                kind=kind, singular=kind.lower(), namespaced=False, subresources={"status"},
                verbs={"get", "list", "watch", "create", "patch", "delete"})
        # kopf waits for these to be discoverable even when it scans neither of them.
        emulator.resources["v1/namespaces"] = kmock.ResourceInfo(
            kind="Namespace", singular="namespace", namespaced=False, verbs={"get", "list"})
        emulator.resources["v1/events"] = kmock.ResourceInfo(
            kind="Event", singular="event", namespaced=True, verbs={"create", "list"})
        emulator.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = (
            kmock.ResourceInfo(kind="CustomResourceDefinition",
                               singular="customresourcedefinition", namespaced=False,
                               verbs={"get", "list"}))
        kubeconfig = str(_kubeconfig(tmp_path, str(emulator.url)))
        monkeypatch.setenv("KUBECONFIG", kubeconfig)
        # The client library reads $KUBECONFIG once, at import; kopf and the operator use it.
        monkeypatch.setattr(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION",
                            kubeconfig)
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        yield emulator


def _kubeconfig(tmp_path: Path, url: str) -> Path:
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
        "clusters": [{"name": "emulator", "cluster": {"server": url.rstrip("/")}}],
        "users": [{"name": "tester", "user": {"token": "test-token"}}],
        "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "tester"}}],
    }
    path = tmp_path / "kubeconfig.json"
    path.write_text(json.dumps(config))
    return path


class Operator:
    """Starts and stops the operator (kopf's CLI runner in a thread) against the emulator."""

    def __init__(self, stop_timeout_s: float = 30.0) -> None:
        self._runner: KopfRunner | None = None
        self.stop_timeout_s = stop_timeout_s
        """How long a stop may take (a hang guard): the handlers under way end first."""

    async def start(self, *extra: str) -> None:
        self._runner = KopfRunner(["run", "-A", "--standalone", *extra],
                                  registry=handlers.registry, timeout=self.stop_timeout_s)
        await asyncio.to_thread(self._runner.__enter__)

    async def stop(self) -> KopfRunner:
        runner, self._runner = self._runner, None
        assert runner is not None
        await asyncio.to_thread(runner.__exit__, None, None, None)
        return runner


@pytest_asyncio.fixture()
async def operator(cluster: ClusterEmulator) -> AsyncIterator[Operator]:
    op = Operator()
    await op.start()
    try:
        yield op
    finally:
        if op._runner is not None:
            await op.stop()


@contextlib.asynccontextmanager
async def operator_beside(controllers: Coroutine[Any, Any, None],
                          memo: kopf.Memo | None = None) -> AsyncIterator[None]:
    """The operator running while `controllers` (a stand-in for the cluster's own controllers,
    e.g. `KubeStandIn.run()`) runs as a task; both stopped on exit, the operator first. With a
    `memo` (the installation `dlo operator run` passes, a test clock), the operator runs as
    `dlo operator run` starts it (`operator_with`): kopf's test runner takes no memo."""
    task = asyncio.create_task(controllers)
    try:
        if memo is None:
            operator = Operator()
            await operator.start()
            try:
                yield
            finally:
                await operator.stop()
        else:
            async with operator_with(memo):
                yield
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


@contextlib.asynccontextmanager
async def operator_with(memo: kopf.Memo) -> AsyncIterator[None]:
    """The operator with `memo`, as `dlo operator run` starts it: kopf in a thread of its own."""
    stop, ready = threading.Event(), threading.Event()
    thread = threading.Thread(target=asyncio.run, args=(kopf.operator(
        registry=handlers.registry, clusterwide=True, standalone=True, memo=memo,
        stop_flag=stop, ready_flag=ready),))
    thread.start()
    try:
        await asyncio.to_thread(ready.wait)
        yield
    finally:
        stop.set()
        await asyncio.to_thread(thread.join)
        collect_kopf_leftovers()


def collect_kopf_leftovers() -> None:
    """kopf leaves the connections of its credentials vault's API sessions open when its loop
    ends (in reference cycles with the dead loop); collect them here, where they were made, so
    that their ResourceWarnings are not raised in whichever later test the collector happens
    to run in. Only kopf's leftovers are ignored: the filter is on for this one collection."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


@pytest.fixture
def clock() -> ShiftedClock:
    """The operator's clock, which a test moves forward (`operator_beside(..., memo)`)."""
    return ShiftedClock()


@dataclasses.dataclass
class ShiftedClock:
    """The operator's clock (`memo.clock`) in a test: the real time plus `offset`, which the
    test moves forward instead of waiting."""

    offset: datetime.timedelta = datetime.timedelta()

    def __call__(self) -> datetime.datetime:
        return datetime.datetime.now(datetime.timezone.utc) + self.offset


def dod_status(cluster: ClusterEmulator, name: str = "flux") -> dict[str, Any]:
    """The status of the DOD `name`, empty while it has none (or is gone)."""
    return (live(cluster, DOD_RESOURCE, name) or {}).get("status") or {}


async def eventually(check: Callable[[], Any], *, timeout: float = 20.0) -> Any:
    """Poll `check` until it returns something truthy (the operator works asynchronously)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            value = check()
        except (KeyError, ValueError, AssertionError):
            value = None
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"condition not reached within {timeout} s: {check.__doc__}")
        await asyncio.sleep(0.1)


def live(cluster: ClusterEmulator, resource: str, name: str) -> dict[str, Any] | None:
    """The current state of an object, or None if it does not exist."""
    key = (kmock.resource(resource), NAMESPACE, name)
    if key not in cluster.objects or cluster.objects[key].deleted:
        return None
    return cluster.objects[key].raw


_VERBS = {kmock.action.FETCH: "get", kmock.action.LIST: "list", kmock.action.WATCH: "watch",
          kmock.action.CREATE: "create", kmock.action.DELETE: "delete"}


def used_rules(cluster: ClusterEmulator) -> dict[tuple[str, str], set[str]]:
    """The RBAC rules the code under test used: (API group, resource[/subresource]) -> verbs of
    every request it made to the emulator (the tests' own requests and discovery, which names no
    resource, left out)."""
    used: dict[tuple[str, str], set[str]] = {}
    for r in list(cluster):
        if (r.headers.get("User-Agent") == TEST_USER_AGENT or r.resource is None
                or r.resource.plural is None or r.action is None):
            continue
        verb = _VERBS.get(r.action) or ("update" if r.method == "PUT" else "patch")
        resource = f"{r.resource.plural}/{r.subresource}" if r.subresource else r.resource.plural
        used.setdefault((r.resource.group or "", resource), set()).add(verb)
    return used


async def request(cluster: ClusterEmulator, method: str, path: str, body: Any = None,
                  content_type: str = "application/merge-patch+json") -> dict[str, Any]:
    headers = {"Content-Type": content_type if method == "PATCH" else "application/json",
               "User-Agent": TEST_USER_AGENT}
    async with cluster.request(method, path, data=json.dumps(body) if body is not None else None,
                               headers=headers) as response:
        assert response.status < 300, await response.text()
        return await response.json()


def workload_pod(cluster: ClusterEmulator, dod: str, index: int, node: str) -> dict[str, Any]:
    """A pod as the StatefulSet controller creates it: its labels and the annotations of the
    StatefulSet's template (its revision among them); the status comes later."""
    sts = live(cluster, "apps/v1/statefulsets", dod) or {}
    template = (sts.get("spec") or {}).get("template") or {}
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": f"{dod}-{index}", "namespace": NAMESPACE, "labels": {
            LABEL_DEPLOYMENT: dod, LABEL_POD_INDEX: str(index)},
            "annotations": dict((template.get("metadata") or {}).get("annotations") or {})},
        "spec": {"nodeName": node},
    }


def fill_secret(cluster: ClusterEmulator, dod: str) -> bytes:
    """The fill secret the operator made for `dod` (its loaders' `DLO_FILL_SECRET_FILE`)."""
    secret = live(cluster, "v1/secrets", f"{dod}-fill-secret") or {}
    value = base64.b64decode(((secret.get("data") or {}).get("secret")) or "")
    assert value, f"the operator made no fill Secret for {dod}"
    return value
