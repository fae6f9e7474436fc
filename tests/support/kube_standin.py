"""A test-side stand-in for the parts of a cluster the operator relies on but does not run: the
StatefulSet and Job controllers, the scheduler and the kubelet, with a model of each node's cache
and of the loader protocol.

It polls the emulator and writes through its API (so watches fire), like the real controllers:
- StatefulSet: creates the pods `<sts>-<i>` its template asks for (one per node), deletes those
  beyond `replicas`, rolls outdated pods (another template: any change of it, by its hash, the
  `controller-revision-hash` label) one at a time from the highest ordinal once every pod is
  Ready, and deletes the pods of a deleted StatefulSet (the garbage collector).
- Job (Indexed): creates one pod per index, places them on the nodes its required node affinity
  names (one per node), sets `Complete` or `Failed` once every pod finished; deletes the pods of
  a deleted Job.
- the API server's admission: while `refusing` names a controller kind, the pods it would create
  are refused, and the controller posts a Warning Event `FailedCreate` worded as the real one.
- kubelet: resolves each loader's environment as the kubelet would (values, `fieldRef`,
  optional `configMapKeyRef`), reads the settings from the mounted ConfigMap, and runs a model of
  `dlo cache fill`: a node holding the entry reads nothing; a group (from `RANK`/`WORLD_SIZE` or
  the fill-group document, with the loader's own precedence) starts once all its members run,
  each member reads its 1/W share unless its node holds the entry; a member that waits longer
  than `rendezvous_timeout_s` is recorded as a rendezvous timeout and reads everything itself.
  It writes the loader's terminated state with the one-line summary, then marks the pod Ready.
  (A workload pod's real loader is a sidecar that stays running and turns ready, its summary
  read from its endpoint; the status takes both forms, and tests/operator/test_operator_metrics.py
  drives the sidecar's with a real loader endpoint.)

Every byte "read from the store" is counted in `store_bytes`, every loader run in `fills`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import kmock
import kopf

from dlo_contract.fill_group import FillGroup
from dlo_contract.names import FILL_GROUP_ENV, POD_NAME_ENV, REVISION_ENV
from dlo_operator.naming import (
    LABEL_DEPLOYMENT,
    LABEL_JOB_INDEX,
    LABEL_POD_INDEX,
    LABEL_ROLE,
)
from support.operator_harness import (
    NAMESPACE,
    PODS_PATH,
    ClusterEmulator,
    ShiftedClock,
    operator_beside,
    request,
)

JOBS_PATH = f"/apis/batch/v1/namespaces/{NAMESPACE}/jobs"
CONTROLLER_REVISION = "controller-revision-hash"
EVENTS_PATH = f"/api/v1/namespaces/{NAMESPACE}/events"


@dataclass(frozen=True)
class Fill:
    """One loader run: where, what, in which group, and what it read from the store."""

    pod: str
    node: str
    source: str
    rank: int
    world: int
    bytes_from_store: int
    cached: bool
    ok: bool


@dataclass
class _Waiting:
    pod: Mapping[str, Any]
    rank: int
    source: str
    container: str
    since: float


@dataclass
class KubeStandIn:
    cluster: ClusterEmulator
    nodes: list[str]
    store: dict[str, int]
    """Source URI -> bytes of its entry (the model's size)."""
    rendezvous_timeout_s: float = 4.0
    caches: dict[str, set[str]] = field(default_factory=dict)
    """Node -> sources whose entry the node's cache holds."""
    failing: dict[str, str] = field(default_factory=dict)
    """Source -> error of every fill of it (a store that refuses it)."""
    hold_prefill: bool = False
    """Keep prefill loaders running until cleared (to look at the cluster mid-prefill)."""
    unschedulable: str = ""
    """The scheduler's message for the prefill pods created while set: they stay Pending on no
    node (the nodes they are pinned to are full)."""
    refusing: dict[str, str] = field(default_factory=dict)
    """Controller kind ("StatefulSet", "Job") -> why the API server refuses the pods it creates
    while set (Pod Security, a quota): no pod, a `FailedCreate` Event on the controller."""
    fills: list[Fill] = field(default_factory=list)
    store_bytes: int = 0
    rendezvous_timeouts: list[str] = field(default_factory=list)
    _waiting: dict[tuple[str, int], dict[int, _Waiting]] = field(default_factory=dict)
    _started: set[str] = field(default_factory=set)
    _refusals: set[tuple[str, str]] = field(default_factory=set)

    async def run(self) -> None:
        while True:
            await self.step()
            await asyncio.sleep(0.05)

    async def step(self) -> None:
        for sts in self._objects("apps/v1/statefulsets"):
            await self._statefulset(sts)
        for job in self._objects("batch/v1/jobs"):
            await self._job(job)
        await self._collect_orphans()
        await self._kubelet()

    # -- reading the emulator ------------------------------------------------------------------

    def _objects(self, resource: str) -> list[dict[str, Any]]:
        wanted = kmock.resource(resource)
        return [obj.raw for (res, ns, _), obj in list(self.cluster.objects.items())
                if res == wanted and ns == NAMESPACE and not obj.deleted]

    def _get(self, resource: str, name: str) -> dict[str, Any] | None:
        return next((o for o in self._objects(resource) if o["metadata"]["name"] == name), None)

    def pods(self) -> list[dict[str, Any]]:
        return [p for p in self._objects("v1/pods")
                if not p["metadata"].get("deletionTimestamp")]

    # -- StatefulSet controller ----------------------------------------------------------------

    async def _statefulset(self, sts: dict[str, Any]) -> None:
        name = sts["metadata"]["name"]
        replicas = int(sts["spec"].get("replicas", 1))
        template = sts["spec"]["template"]
        revision = f"{name}-{_template_hash(template)}"
        mine = {p["metadata"]["name"]: p for p in self.pods() if _workload_of(p) == name}
        for pod_name, pod in mine.items():
            if _ordinal(pod_name) >= replicas:
                await self._delete_pod(pod_name)
        for index in range(replicas):
            if f"{name}-{index}" not in mine:
                if not await self._refused(sts, f"{name}-{index}"):
                    await self._create_pod(f"{name}-{index}", template, {
                        LABEL_POD_INDEX: str(index), CONTROLLER_REVISION: revision}, {},
                        self._free_node(mine.values()))
                return  # the next step sees it
        current = [mine[f"{name}-{i}"] for i in range(replicas)]
        outdated = [p for p in current if p["metadata"]["labels"].get(CONTROLLER_REVISION)
                    != revision]
        if outdated and all(_ready(p) for p in current):
            await self._delete_pod(max(outdated, key=lambda p: _ordinal(
                p["metadata"]["name"]))["metadata"]["name"])

    def _free_node(self, pods: Any) -> str:
        taken = {p["spec"].get("nodeName") for p in pods}
        return next(n for n in self.nodes if n not in taken)

    # -- Job controller ------------------------------------------------------------------------

    async def _job(self, job: dict[str, Any]) -> None:
        name = job["metadata"]["name"]
        if any(c.get("status") == "True" for c in (job.get("status") or {}).get("conditions", [])):
            return
        uid = job["metadata"]["uid"]
        pods = [p for p in self.pods() if p["metadata"]["labels"].get("controller-uid") == uid]
        completions = int(job["spec"]["completions"])
        if not pods:
            terms = job["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
                "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
            nodes = terms[0]["matchFields"][0]["values"]
            for index in range(completions):
                pod = f"{name}-{index}-{uid[:5]}"
                if await self._refused(job, pod):
                    return
                await self._create_pod(
                    pod, job["spec"]["template"],
                    {"job-name": name, "controller-uid": uid, LABEL_JOB_INDEX: str(index)},
                    {LABEL_JOB_INDEX: str(index)}, "" if self.unschedulable else nodes[index])
                if self.unschedulable:
                    await request(self.cluster, "PATCH", f"{PODS_PATH}/{pod}/status", {
                        "status": {"phase": "Pending", "conditions": [{
                            "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                            "message": self.unschedulable}]}})
            return
        codes = [_exit_code(p, "containerStatuses") for p in pods]
        if None in codes:
            return
        kind = "Complete" if all(c == 0 for c in codes) else "Failed"
        await request(self.cluster, "PATCH", f"{JOBS_PATH}/{name}/status", {"status": {
            "conditions": [{"type": kind, "status": "True",
                            "reason": "Completed" if kind == "Complete" else
                            "BackoffLimitExceeded"}]}})

    async def _refused(self, controller: Mapping[str, Any], pod: str) -> bool:
        """Whether the API server refuses `pod` (`refusing`); if so, its controller's Warning
        Event `FailedCreate`, worded as the real controller words it, once per message (the
        real recorder counts repeats on one Event)."""
        kind = "StatefulSet" if "serviceName" in controller["spec"] else "Job"
        why = self.refusing.get(kind)
        if why is None:
            return False
        meta = controller["metadata"]
        error = f'pods "{pod}" is forbidden: {why}'
        message = (f"create Pod {pod} in StatefulSet {meta['name']} failed error: {error}"
                   if kind == "StatefulSet" else f"Error creating: {error}")
        if (meta["uid"], message) not in self._refusals:
            self._refusals.add((meta["uid"], message))
            now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            await request(self.cluster, "POST", EVENTS_PATH, {
                "apiVersion": "v1", "kind": "Event", "type": "Warning", "reason": "FailedCreate",
                "metadata": {"generateName": f"{meta['name']}.", "namespace": NAMESPACE},
                "involvedObject": {"kind": kind, "namespace": NAMESPACE, "name": meta["name"],
                                   "uid": meta["uid"], "apiVersion": "apps/v1"
                                   if kind == "StatefulSet" else "batch/v1"},
                "source": {"component": f"{kind.lower()}-controller"}, "message": message,
                "count": 1, "firstTimestamp": now, "lastTimestamp": now})
        return True

    async def _collect_orphans(self) -> None:
        """The garbage collector: pods whose StatefulSet or Job is gone."""
        sets = {s["metadata"]["name"] for s in self._objects("apps/v1/statefulsets")}
        jobs = {j["metadata"]["uid"] for j in self._objects("batch/v1/jobs")}
        for pod in self.pods():
            labels = pod["metadata"]["labels"]
            job = labels.get("controller-uid")
            if (job and job not in jobs) or (not job and _workload_of(pod) not in sets):
                await self._delete_pod(pod["metadata"]["name"])

    # -- pods ----------------------------------------------------------------------------------

    async def _create_pod(self, name: str, template: Mapping[str, Any], labels: dict[str, str],
                          annotations: dict[str, str], node: str) -> None:
        meta = template.get("metadata") or {}
        body = {"apiVersion": "v1", "kind": "Pod", "metadata": {
            "name": name, "namespace": NAMESPACE,
            "labels": {**meta.get("labels", {}), **labels},
            "annotations": {**meta.get("annotations", {}), **annotations}},
            "spec": {**template["spec"], "nodeName": node}}
        await request(self.cluster, "POST", PODS_PATH, body)

    async def _delete_pod(self, name: str) -> None:
        await request(self.cluster, "DELETE", f"{PODS_PATH}/{name}")

    # -- kubelet and the loader model ----------------------------------------------------------

    async def _kubelet(self) -> None:
        for pod in self.pods():
            name, uid = pod["metadata"]["name"], pod["metadata"]["uid"]
            if uid in self._started or not pod["spec"].get("nodeName"):
                continue  # started already, or not scheduled
            prefill = pod["metadata"]["labels"].get(LABEL_ROLE) == "prefill"
            container = "containerStatuses" if prefill else "initContainerStatuses"
            spec = pod["spec"]
            loader = (spec["containers"] if prefill else spec["initContainers"])[0]
            env = self._env(pod, loader)
            source = self._source(pod)
            if env is None or source is None:
                continue  # a missing ConfigMap: the kubelet cannot start the container
            self._started.add(uid)
            await self._set_loader(pod, container, {"running": {"startedAt": time.strftime(
                "%Y-%m-%dT%H:%M:%SZ", time.gmtime())}})
            rank, world, key = _placement(env, name)
            if world == 1:
                await self._finish([_Waiting(pod, 0, source, container, time.monotonic())], 1)
            else:
                self._waiting.setdefault((key, world), {})[rank] = _Waiting(
                    pod, rank, source, container, time.monotonic())
        for (key, world), members in list(self._waiting.items()):
            waited = time.monotonic() - min(m.since for m in members.values())
            prefills = any(m.container == "containerStatuses" for m in members.values())
            if len(members) == world and not (prefills and self.hold_prefill):
                del self._waiting[(key, world)]
                await self._finish(list(members.values()), world)
            elif len(members) < world and waited > self.rendezvous_timeout_s:
                del self._waiting[(key, world)]
                self.rendezvous_timeouts += [m.pod["metadata"]["name"] for m in members.values()]
                for member in members.values():
                    await self._finish([member], 1)

    async def _finish(self, members: list[_Waiting], world: int) -> None:
        source = members[0].source
        size = self.store[source]
        error = self.failing.get(source)
        for member in members:
            pod = member.pod
            node = pod["spec"]["nodeName"]
            holds = source in self.caches.setdefault(node, set())
            share = size // world + (size % world if member.rank == 0 else 0)
            read = 0 if holds or error else share if world > 1 else size
            self.store_bytes += read
            name = pod["metadata"]["name"]
            self.fills.append(Fill(name, node, source, member.rank, world, read, holds,
                                   error is None))
            if error is not None:
                summary = {"status": "error", "rank": member.rank, "error": error}
                await self._set_loader(pod, member.container, {"terminated": {
                    "exitCode": 1, "reason": "Error", "message": json.dumps(summary)}})
                continue
            self.caches[node].add(source)
            summary = {"status": "ok", "entry_id": f"entry-of-{source}", "rank": member.rank,
                       "mode": "multi-reader" if world > 1 else "independent",
                       "world_size": world, "bytes_from_store": read,
                       "bytes_from_peers": 0 if holds else size - read, "bytes_to_peers": 0,
                       "seconds": 0.1, "cached": holds}
            await self._set_loader(pod, member.container, {"terminated": {
                "exitCode": 0, "reason": "Completed", "message": json.dumps(summary)}})
            if member.container == "initContainerStatuses":
                await request(self.cluster, "PATCH", f"{PODS_PATH}/{name}/status", {"status": {
                    "phase": "Running", "conditions": [{"type": "Ready", "status": "True"}],
                    "containerStatuses": [{"name": "inference", "ready": True,
                                           "restartCount": 0, "state": {"running": {}}}]}})

    async def _set_loader(self, pod: Mapping[str, Any], container: str,
                          state: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        if self._get("v1/pods", name) is None:
            return
        await request(self.cluster, "PATCH", f"{PODS_PATH}/{name}/status", {"status": {
            container: [{"name": "loader", "restartCount": 0, "state": state}]}})

    def _env(self, pod: Mapping[str, Any], container: Mapping[str, Any]) -> dict[str, str] | None:
        env: dict[str, str] = {}
        for item in container.get("env", []):
            source = item.get("valueFrom") or {}
            if "value" in item:
                env[item["name"]] = item["value"]
            elif "fieldRef" in source:
                env[item["name"]] = _field(pod, source["fieldRef"]["fieldPath"])
            elif "configMapKeyRef" in source:
                ref = source["configMapKeyRef"]
                found = self._get("v1/configmaps", ref["name"])
                if found is None and not ref.get("optional"):
                    return None
                if found is not None and ref["key"] in (found.get("data") or {}):
                    env[item["name"]] = found["data"][ref["key"]]
        return env

    def _source(self, pod: Mapping[str, Any]) -> str | None:
        volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "settings")
        found = self._get("v1/configmaps", volume["configMap"]["name"])
        if found is None:
            return None
        return json.loads(found["data"]["settings.json"])["loader"]["source"]


def _placement(env: Mapping[str, str], pod: str) -> tuple[int, int, str]:
    """(rank, world, group key) with the loader's precedence: RANK/WORLD_SIZE, then the
    fill-group document, else alone."""
    if env.get("WORLD_SIZE"):
        return int(env.get("RANK", "0")), int(env["WORLD_SIZE"]), env.get("MASTER_ADDR", "")
    if env.get(FILL_GROUP_ENV):
        group = FillGroup.from_json(env[FILL_GROUP_ENV])
        place = group.place(env.get(POD_NAME_ENV, ""), env.get(REVISION_ENV, ""))
        if place is not None:
            return place[0], place[1], group.master_addr
    return 0, 1, pod


def _field(pod: Mapping[str, Any], path: str) -> str:
    if path == "metadata.name":
        return str(pod["metadata"]["name"])
    if path == "spec.nodeName":
        return str(pod.get("spec", {}).get("nodeName", ""))
    if path.startswith("metadata.annotations['"):
        return str(pod["metadata"].get("annotations", {}).get(path[22:-2], ""))
    if path.startswith("metadata.labels['"):
        return str(pod["metadata"].get("labels", {}).get(path[17:-2], ""))
    raise AssertionError(f"the stand-in kubelet does not resolve fieldPath {path}")


def _workload_of(pod: Mapping[str, Any]) -> str | None:
    labels = pod["metadata"].get("labels", {})
    return None if LABEL_ROLE in labels else labels.get(LABEL_DEPLOYMENT)


def _ordinal(name: str) -> int:
    return int(name.rpartition("-")[2])


def _template_hash(template: Mapping[str, Any]) -> str:
    """The pod template's hash, as the real controller's `controller-revision-hash`: any change
    of the template (not only of the DOD's revision) rolls the pods."""
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


def _ready(pod: Mapping[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions", []))


def _exit_code(pod: Mapping[str, Any], container: str) -> int | None:
    for status in (pod.get("status") or {}).get(container, []):
        terminated = (status.get("state") or {}).get("terminated")
        if terminated is not None:
            return int(terminated.get("exitCode", 1))
    return None


@contextlib.asynccontextmanager
async def standin_and_operator(cluster: ClusterEmulator, store: dict[str, int],
                               clock: ShiftedClock | None = None,
                               nodes: Sequence[str] = ("gpu-0", "gpu-1"),
                               ) -> AsyncIterator[KubeStandIn]:
    """A stand-in over `nodes` serving `store`, beside the operator (on `clock`, when given)."""
    fake = KubeStandIn(cluster, nodes=list(nodes), store=dict(store))
    async with operator_beside(fake.run(), memo=None if clock is None else kopf.Memo(
            clock=clock)):
        yield fake
