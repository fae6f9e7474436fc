"""The operator end to end: kopf's runner against the Kubernetes API emulator."""

from __future__ import annotations

import asyncio
import http.server
import json
import socket
import threading
import time
from typing import Any

import aiohttp

from support.operator_harness import (
    DOD_PATH,
    DOD_RESOURCE,
    NAMESPACE,
    PODS_PATH,
    ClusterEmulator,
    Operator,
    eventually,
    live,
    request,
    workload_pod,
)

CONFIGMAPS = "v1/configmaps"
SERVICES = "v1/services"
STATEFULSETS = "apps/v1/statefulsets"
BUDGETS = "policy/v1/poddisruptionbudgets"


def dod(name: str = "flux", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "dlo.dev/v1alpha1", "kind": "DiffusionOffloadDeployment",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"replicas": 2, "model": {"source": "s3://models/flux/"},
                 "inference": {"image": "server:1"}, **spec},
    }


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == kind)


def settings_configmap(cluster: ClusterEmulator, name: str) -> dict[str, Any] | None:
    """The settings ConfigMap the StatefulSet's pod template mounts (one per revision)."""
    sts = live(cluster, STATEFULSETS, name)
    if sts is None:
        return None
    volume = next(v for v in sts["spec"]["template"]["spec"]["volumes"] if v["name"] == "settings")
    return live(cluster, CONFIGMAPS, volume["configMap"]["name"])


def children(cluster: ClusterEmulator, name: str) -> list[dict[str, Any] | None]:
    return [settings_configmap(cluster, name), live(cluster, CONFIGMAPS, f"{name}-fill-group"),
            live(cluster, SERVICES, f"{name}-peers"), live(cluster, STATEFULSETS, name)]


async def test_create_makes_owned_children_and_pods_drive_the_status(
        cluster: ClusterEmulator, operator: Operator) -> None:
    created = await request(cluster, "POST", DOD_PATH, dod())
    uid = created["metadata"]["uid"]

    found = await eventually(lambda: all(children(cluster, "flux")) and children(cluster, "flux"))
    for child in found:
        assert child["metadata"]["ownerReferences"] == [{
            "apiVersion": "dlo.dev/v1alpha1", "kind": "DiffusionOffloadDeployment",
            "name": "flux", "uid": uid, "controller": True, "blockOwnerDeletion": True}]
    status = await eventually(lambda: live(cluster, DOD_RESOURCE, "flux")["status"])
    assert (status["phase"], condition(status, "Valid")["status"]) == ("Pending", "True")
    assert status["observedGeneration"] == 1

    # The StatefulSet controller creates the pods; the kubelet reports the loaders' progress.
    for index in (0, 1):
        await request(cluster, "POST", PODS_PATH,
                      workload_pod(cluster, "flux", index, f"gpu-{index}"))
    await _loader(cluster, "flux-0", {"state": {"running": {}}})
    await eventually(lambda: live(cluster, DOD_RESOURCE, "flux")["status"]["phase"] == "Loading")

    summary = {"status": "ok", "entry_id": "e" * 64, "mode": "multi-reader", "rank": 0,
               "world_size": 2, "bytes_from_store": 600, "bytes_from_peers": 400,
               "bytes_to_peers": 600, "seconds": 2.5, "cached": False}
    await _loader(cluster, "flux-0", {"state": {"terminated": {
        "exitCode": 0, "reason": "Completed", "message": json.dumps(summary)}}})
    await _loader(cluster, "flux-1", {"restartCount": 3, "state": {"waiting": {
        "reason": "CrashLoopBackOff"}}, "lastState": {"terminated": {
            "exitCode": 1, "message": json.dumps({
                "status": "error", "rank": 1, "error": "s3://models/flux/ not readable: 403"})}}})
    status = await eventually(lambda: _phase_is(cluster, "Degraded"))
    assert status["message"] == (
        "loader container of pod flux-1 on node gpu-1: LoaderFailed: "
        "CrashLoopBackOff: s3://models/flux/ not readable: 403")
    assert await eventually(lambda: _events(cluster, "LoaderFailed")) == [{
        "type": "Warning", "reason": "LoaderFailed", "message": status["message"]}]
    assert condition(status, "CacheReady")["reason"] == "LoaderFailed"
    assert status["nodes"][0] | {} == {
        "pod": "flux-0", "node": "gpu-0", "rank": 0, "loader": "Cached", "restarts": 0,
        "ready": False, "entryId": "e" * 64, "mode": "multi-reader", "bytesFromStore": 600,
        "bytesFromPeers": 400, "seconds": 2.5, "cached": False}

    await _loader(cluster, "flux-1", {"restartCount": 4, "state": {"terminated": {
        "exitCode": 0, "message": json.dumps({**summary, "rank": 1})}}})
    for index in (0, 1):
        await request(cluster, "PATCH", f"{PODS_PATH}/flux-{index}/status", {"status": {
            "conditions": [{"type": "Ready", "status": "True"}]}})
    status = await eventually(lambda: _phase_is(cluster, "Ready"))
    assert [condition(status, t)["status"] for t in ("Valid", "CacheReady", "Available")] == [
        "True", "True", "True"]
    assert (status["ready"], status["cache"]) == ("2/2", "2/2")


async def test_invalid_spec_is_reported_and_creates_nothing(
        cluster: ClusterEmulator, operator: Operator) -> None:
    await request(cluster, "POST", DOD_PATH, dod(parallel={"hsdp": True}))

    status = await eventually(lambda: live(cluster, DOD_RESOURCE, "flux")["status"])
    assert status["phase"] == "Failed"
    message = ("spec.parallel.hsdp: [hsdp-allgather] HSDP with DLO AllGather would shard "
               "parameters twice; fix: set spec.offload.useAllgather=false (HSDP then keeps "
               "rank-local tensors)")
    assert condition(status, "Valid") | {"lastTransitionTime": None} == {
        "type": "Valid", "status": "False", "reason": "SpecInvalid", "lastTransitionTime": None,
        "observedGeneration": 1, "message": message}
    assert condition(status, "Ready")["reason"] == "SpecInvalid"
    assert await eventually(lambda: _events(cluster, "SpecInvalid")) == [{
        "type": "Warning", "reason": "SpecInvalid", "message": message}]
    assert children(cluster, "flux") == [None, None, None, None]
    assert not _child_writes(cluster)


async def test_an_api_error_is_reported_and_retried_with_backoff(
        cluster: ClusterEmulator, operator: Operator) -> None:
    peers = f"/api/v1/namespaces/{NAMESPACE}/services/flux-peers"
    refused = cluster["patch", peers][:2] << 503 << {
        "kind": "Status", "code": 503, "message": "etcdserver: leader changed"}
    await request(cluster, "POST", DOD_PATH, dod())

    retrying = await eventually(lambda: _events(cluster, "ApplyRetrying"))
    assert retrying[0]["type"] == "Warning"
    assert retrying[0]["message"].startswith(
        "Kubernetes API answered 503 for Service inference/flux-peers: etcdserver: leader "
        "changed; attempt 2 in 1 s")
    await eventually(lambda: all(children(cluster, "flux")))
    status = await eventually(lambda: _condition_is(cluster, "Applied", "True"))
    assert condition(status, "Applied")["reason"] == "ChildrenApplied"
    refusals = len(list(refused))
    assert 1 <= refusals <= 2  # the reaction answers at most twice; one event per refusal
    assert [e["message"][-16:] for e in _events(cluster, "ApplyRetrying")] == [
        "attempt 2 in 1 s", "attempt 3 in 2 s"][:refusals]


async def test_a_refused_apply_waits_for_the_next_spec_change(
        cluster: ClusterEmulator, operator: Operator) -> None:
    cluster["patch", f"/api/v1/namespaces/{NAMESPACE}/services/flux-peers"][:1] << 422 << {
        "kind": "Status", "code": 422, "message": 'Service "flux-peers" is invalid'}
    await request(cluster, "POST", DOD_PATH, dod())

    status = await eventually(lambda: _condition_is(cluster, "Applied", "False"))
    assert (status["phase"], condition(status, "Applied")["reason"]) == ("Failed", "ApplyFailed")
    assert status["message"].startswith(
        'Kubernetes API answered 422 for Service inference/flux-peers: Service "flux-peers" is '
        "invalid; retried when the spec changes")
    assert [e["type"] for e in await eventually(lambda: _events(cluster, "ApplyFailed"))] == [
        "Warning"]
    assert live(cluster, STATEFULSETS, "flux") is None  # nothing after the refused child

    await request(cluster, "PATCH", f"{DOD_PATH}/flux", {"spec": {"replicas": 3}})
    status = await eventually(lambda: _condition_is(cluster, "Applied", "True"))
    assert condition(status, "Applied")["observedGeneration"] == 2
    assert live(cluster, STATEFULSETS, "flux")["spec"]["replicas"] == 3


async def test_update_rolls_the_statefulset(cluster: ClusterEmulator, operator: Operator) -> None:
    await request(cluster, "POST", DOD_PATH, dod())
    before = await eventually(lambda: live(cluster, STATEFULSETS, "flux"))
    old_hash = before["spec"]["template"]["metadata"]["annotations"]["dlo.dev/settings-sha256"]

    await request(cluster, "PATCH", f"{DOD_PATH}/flux", {"spec": {
        "offload": {"useAllgather": False, "residentLayers": 2}, "replicas": 3}})

    # The restart rolls the live 2 pods; the scale-up follows one step later (its new pods
    # fill as a group of their own), so wait for both.
    after = await eventually(lambda: (sts := _rolled(cluster, old_hash)) and sts["spec"][
        "replicas"] == 3 and sts)
    settings = json.loads(settings_configmap(cluster, "flux")["data"]["settings.json"])
    assert (settings["offload"]["use_allgather"], settings["offload"]["resident_layers"]) == (
        False, 2)
    await eventually(lambda: live(cluster, DOD_RESOURCE, "flux")["status"][
        "observedGeneration"] == 2)


async def test_optional_children_the_spec_turns_off_are_deleted(
        cluster: ClusterEmulator, operator: Operator) -> None:
    await request(cluster, "POST", DOD_PATH, dod(
        disruptionBudget={"enabled": True},
        inference={"image": "server:1", "ports": [{"containerPort": 8000, "name": "http"}]}))
    await eventually(lambda: live(cluster, BUDGETS, "flux") and live(cluster, SERVICES, "flux"))

    await request(cluster, "PATCH", f"{DOD_PATH}/flux", {"spec": {
        "disruptionBudget": {"enabled": False}, "inference": {"ports": None}}})

    await eventually(lambda: live(cluster, BUDGETS, "flux") is None
                     and live(cluster, SERVICES, "flux") is None)
    assert all(children(cluster, "flux"))


async def test_restart_resumes_without_duplicates(
        cluster: ClusterEmulator, operator: Operator) -> None:
    await request(cluster, "POST", DOD_PATH, dod())
    first = await eventually(lambda: all(children(cluster, "flux")) and children(cluster, "flux"))
    await operator.stop()
    writes_before = len(_child_writes(cluster))

    await operator.start()
    # The resumed operator reads every child and finds nothing drifted: it writes nothing.
    reads = len(_statefulset_reads(cluster))
    await eventually(lambda: len(_statefulset_reads(cluster)) > reads)
    await operator.stop()

    assert len(_child_writes(cluster)) == writes_before
    again = children(cluster, "flux")
    assert [c["metadata"]["uid"] for c in again] == [c["metadata"]["uid"] for c in first]
    assert [c["metadata"]["generation"] for c in again] == [1, 1, 1, 1]
    assert len([key for key in cluster.objects if key[0].plural == "statefulsets"]) == 1


async def test_delete_leaves_children_to_owner_references(
        cluster: ClusterEmulator, operator: Operator) -> None:
    await request(cluster, "POST", DOD_PATH, dod())
    await eventually(lambda: live(cluster, DOD_RESOURCE, "flux")["metadata"].get("finalizers"))
    await eventually(lambda: all(children(cluster, "flux")))

    await request(cluster, "DELETE", f"{DOD_PATH}/flux")

    await eventually(lambda: live(cluster, DOD_RESOURCE, "flux") is None)
    assert all(children(cluster, "flux"))  # the cluster's garbage collector removes them
    deleted = await eventually(lambda: _events(cluster, "Deleted"))  # posted in the background
    assert deleted[0]["type"] == "Normal"


async def test_delete_is_not_held_by_a_timer_in_flight(
        cluster: ClusterEmulator, operator: Operator) -> None:
    """kopf removes the finalizer only once the DOD's timers have stopped; a timer caught in
    the middle of a run (here the progress timer reading a loader endpoint that answers slowly)
    must not hold the deletion for kopf's default minute between checks."""
    reading = threading.Event()

    class SlowLoader(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            reading.set()
            time.sleep(1.5)  # inside the operator's 2 s read timeout: the timer waits it out
            self.send_error(503)

        def log_message(self, *_: Any) -> None:
            pass

    slow = http.server.ThreadingHTTPServer(("127.0.0.1", 0), SlowLoader)
    threading.Thread(target=slow.serve_forever, daemon=True).start()
    try:
        await request(cluster, "POST", DOD_PATH, dod(
            replicas=1, loader={"metricsPort": slow.server_address[1]}))
        await eventually(lambda: live(cluster, DOD_RESOURCE, "flux")["metadata"].get("finalizers"))
        await request(cluster, "POST", PODS_PATH, workload_pod(cluster, "flux", 0, "gpu-0"))
        await request(cluster, "PATCH", f"{PODS_PATH}/flux-0/status", {"status": {
            "podIP": "127.0.0.1", "initContainerStatuses": [
                {"name": "loader", "restartCount": 0, "state": {"running": {}}}]}})
        reading.clear()
        await eventually(reading.is_set)  # the progress timer is now inside its read

        await request(cluster, "DELETE", f"{DOD_PATH}/flux")

        # Gone well inside kopf's minute between checks (about 6 s here alone; 10 s was too
        # tight for a loaded 2-core CI machine).
        await eventually(lambda: live(cluster, DOD_RESOURCE, "flux") is None, timeout=30.0)
    finally:
        slow.shutdown()
        slow.server_close()


async def test_liveness_endpoint_answers(cluster: ClusterEmulator) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    operator = Operator()
    await operator.start(f"--liveness=http://127.0.0.1:{port}/healthz")
    try:
        async with aiohttp.ClientSession() as session:
            async def healthy() -> bool:
                try:
                    async with session.get(f"http://127.0.0.1:{port}/healthz") as response:
                        return response.status == 200
                except aiohttp.ClientConnectionError:
                    return False
            for _ in range(100):
                if await healthy():
                    break
                await asyncio.sleep(0.1)
            assert await healthy()
    finally:
        await operator.stop()


async def _loader(cluster: ClusterEmulator, pod: str, loader_status: dict[str, Any]) -> None:
    await request(cluster, "PATCH", f"{PODS_PATH}/{pod}/status", {"status": {
        "initContainerStatuses": [{"name": "loader", "restartCount": 0, **loader_status}]}})


def _phase_is(cluster: ClusterEmulator, phase: str) -> dict[str, Any] | None:
    status = live(cluster, DOD_RESOURCE, "flux")["status"]
    return status if status["phase"] == phase else None


def _condition_is(cluster: ClusterEmulator, kind: str, value: str) -> dict[str, Any] | None:
    status = live(cluster, DOD_RESOURCE, "flux").get("status") or {}
    found = [c for c in status.get("conditions", ()) if c["type"] == kind]
    return status if found and found[0]["status"] == value else None


def _events(cluster: ClusterEmulator, reason: str) -> list[dict[str, str]]:
    """The Events posted about the DOD with this reason: type, reason and message."""
    return [{"type": r.data["type"], "reason": r.data["reason"], "message": r.data["message"]}
            for r in list(cluster) if r.resource is not None and r.resource.plural == "events"
            and r.method == "POST" and r.data.get("reason") == reason]


def _rolled(cluster: ClusterEmulator, old_hash: str) -> dict[str, Any] | None:
    sts = live(cluster, STATEFULSETS, "flux")
    annotations = sts["spec"]["template"]["metadata"]["annotations"]
    return sts if annotations["dlo.dev/settings-sha256"] != old_hash else None


def _child_writes(cluster: ClusterEmulator) -> list[Any]:
    return [r for r in list(cluster) if r.resource is not None
            and r.resource.plural in ("configmaps", "services", "statefulsets", "jobs",
                                      "poddisruptionbudgets")
            and r.method in ("POST", "PATCH", "PUT", "DELETE")]


def _statefulset_reads(cluster: ClusterEmulator) -> list[Any]:
    return [r for r in list(cluster) if r.resource is not None and r.method == "GET"
            and r.resource.plural == "statefulsets" and r.name == "flux"]
