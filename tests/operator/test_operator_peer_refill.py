"""Refilling from peers, the operator's part, against the Kubernetes API emulator: the nodes
whose sidecar loader published reach the fill-group document as holders, and a pod whose loader
refilled its node from them gets an Event with the bytes from peers and from the store. A real
loader endpoint on loopback stands in for the sidecars (the emulated pods' `podIP`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from dlo_bench.s3server import free_port
from dlo_loader import metrics as loader_metrics
from support.operator_harness import (
    DOD_PATH,
    NAMESPACE,
    PODS_PATH,
    ClusterEmulator,
    Operator,
    eventually,
    fill_secret,
    live,
    request,
    workload_pod,
)

from dlo_contract.fill_group import FILL_GROUP_KEY, FillGroup, Holder
from dlo_operator.fill_report import REFILLED_FROM_PEERS

MIB = 1 << 20
SUMMARY = {"status": "ok", "entry_id": "e" * 64, "mode": "multi-reader", "rank": 0,
           "world_size": 1, "bytes_from_store": 0, "bytes_from_peers": 0, "bytes_to_peers": 0,
           "seconds": 2.0, "cached": False}


class Sidecar:
    """The sidecar loaders' endpoint: a real one on `port`, started at the first summary it
    publishes with the DOD's fill secret (the operator made it with the DOD's first children)."""

    def __init__(self, cluster: ClusterEmulator) -> None:
        self.cluster, self.port = cluster, free_port()
        self.endpoint: loader_metrics.Endpoint | None = None

    def publish_summary(self, line: str) -> None:
        if self.endpoint is None:
            self.endpoint = loader_metrics.Endpoint(self.port, addr="127.0.0.1",
                                                    secret=fill_secret(self.cluster, "flux"))
        self.endpoint.publish_summary(line)


@pytest.fixture
def loader_endpoint(cluster: ClusterEmulator) -> Iterator[Sidecar]:
    sidecar = Sidecar(cluster)
    try:
        yield sidecar
    finally:
        if sidecar.endpoint is not None:
            sidecar.endpoint.close()


def group_document(cluster: ClusterEmulator) -> FillGroup:
    found = live(cluster, "v1/configmaps", "flux-fill-group") or {}
    return FillGroup.from_json((found.get("data") or {}).get(FILL_GROUP_KEY, "{}"))


def events(cluster: ClusterEmulator, reason: str) -> list[tuple[str, str]]:
    """(type, message) of the Events of `reason` posted on the DOD, in order."""
    return [(e["type"], e["message"]) for r in list(cluster) if r.resource is not None
            and r.resource.plural == "events" and r.method == "POST"
            and (e := r.data)["involvedObject"].get("kind") == "DiffusionOffloadDeployment"
            and e["reason"] == reason]


async def published(cluster: ClusterEmulator, index: int, node: str) -> None:
    """Pod `index` on `node`, its sidecar loader published (running and ready)."""
    await request(cluster, "POST", PODS_PATH, workload_pod(cluster, "flux", index, node))
    await request(cluster, "PATCH", f"{PODS_PATH}/flux-{index}/status", {"status": {
        "podIP": "127.0.0.1", "initContainerStatuses": [
            {"name": "loader", "restartCount": 0, "ready": True, "state": {"running": {}}}]}})


def kept(cluster: ClusterEmulator, index: int) -> dict[str, Any] | None:
    pod = live(cluster, "v1/pods", f"flux-{index}") or {}
    line = ((pod.get("metadata") or {}).get("annotations") or {}).get("dlo.dev/fill-summary")
    return json.loads(line) if line else None


async def test_holders_reach_the_fill_group_document_and_a_refill_is_reported(
        cluster: ClusterEmulator, operator: Operator,
        loader_endpoint: Sidecar) -> None:
    port = loader_endpoint.port
    await request(cluster, "POST", DOD_PATH, {
        "apiVersion": "dlo.dev/v1alpha1", "kind": "DiffusionOffloadDeployment",
        "metadata": {"name": "flux", "namespace": NAMESPACE},
        "spec": {"replicas": 2, "model": {"source": "s3://models/flux/"},
                 "inference": {"image": "server:1"}, "loader": {"metricsPort": port}}})
    await eventually(lambda: live(cluster, "apps/v1/statefulsets", "flux"))

    # gpu-0's loader filled from the store: it holds the entry, and serves it.
    loader_endpoint.publish_summary(json.dumps(SUMMARY | {"bytes_from_store": 64 * MIB}))
    await published(cluster, 0, "gpu-0")
    await eventually(lambda: kept(cluster, 0))

    def holders() -> tuple[Holder, ...]:
        """gpu-0 is named as a holder in the fill-group document"""
        return group_document(cluster).holders

    assert await eventually(holders) == (Holder("gpu-0", "127.0.0.1", port),)
    assert events(cluster, REFILLED_FROM_PEERS) == []  # a fill from the store is no refill

    # flux-1, recreated alone on a wiped gpu-1, read its entry from gpu-0.
    loader_endpoint.publish_summary(json.dumps(SUMMARY | {
        "bytes_from_peers": 60 * MIB, "bytes_from_store": 4 * MIB,
        "bytes_by_peer": [{"node": "gpu-0", "bytes": 60 * MIB}]}))
    await published(cluster, 1, "gpu-1")
    assert (await eventually(lambda: kept(cluster, 1)))["bytes_from_peers"] == 60 * MIB
    posted = await eventually(lambda: events(cluster, REFILLED_FROM_PEERS))
    assert posted == [("Normal", "pod flux-1 refilled node gpu-1 from the nodes that hold its "
                                 "entry: 60.0 MiB from peers (gpu-0 60.0 MiB), 4.0 MiB from "
                                 "the store")]

    def both() -> bool:
        """both nodes hold the entry now"""
        return [h.node for h in group_document(cluster).holders] == ["gpu-0", "gpu-1"]

    await eventually(both)

    def row() -> tuple[int, int, list[dict[str, Any]]]:
        """flux-1's status row has the refill's figures"""
        status = live(cluster, "dlo.dev/v1alpha1/diffusionoffloaddeployments", "flux")["status"]
        found = next(n for n in status["nodes"] if n["pod"] == "flux-1")
        return found["bytesFromPeers"], found["bytesFromStore"], found["bytesByPeer"]

    assert await eventually(row) == (60 * MIB, 4 * MIB, [{"node": "gpu-0", "bytes": 60 * MIB}])
