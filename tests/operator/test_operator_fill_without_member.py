"""A fill group that lost a member, the operator's part, against the Kubernetes API emulator: the
survivors' loader summaries (kept on their pods) put the member they finished without and what
each read again in their status rows, with a Warning Event each; the lost member's node fills
later from the survivors' nodes, with the bytes from each in its row and a Normal Event. A real
loader endpoint on loopback stands in for the sidecars (the emulated pods' `podIP`)."""

from __future__ import annotations

import json
from typing import Any

from support.operator_harness import (
    DOD_PATH,
    NAMESPACE,
    ClusterEmulator,
    Operator,
    dod_status,
    eventually,
    live,
    request,
)
from test_operator_fill_report import REFILL, SURVIVOR
from test_operator_peer_refill import (  # noqa: F401  (loader_endpoint: a fixture)
    Sidecar,
    events,
    kept,
    loader_endpoint,
    published,
)

from dlo_operator.fill_report import FILLED_WITHOUT_MEMBER, REFILLED_FROM_PEERS

MIB = 1 << 20


def rows(cluster: ClusterEmulator) -> dict[str, dict[str, Any]]:
    return {n["pod"]: n for n in dod_status(cluster).get("nodes") or ()}


async def test_survivors_report_the_member_they_lost_and_its_node_refills_from_them(
        cluster: ClusterEmulator, operator: Operator,
        loader_endpoint: Sidecar) -> None:  # noqa: F811
    await request(cluster, "POST", DOD_PATH, {
        "apiVersion": "dlo.dev/v1alpha1", "kind": "DiffusionOffloadDeployment",
        "metadata": {"name": "flux", "namespace": NAMESPACE},
        "spec": {"replicas": 3, "model": {"source": "s3://models/flux/"},
                 "inference": {"image": "server:1"},
                 "loader": {"metricsPort": loader_endpoint.port}}})
    await eventually(lambda: live(cluster, "apps/v1/statefulsets", "flux"))

    # flux-0 and flux-1 finished the group's fill without flux-2, lost mid-fill.
    for rank, again in ((0, 8 * MIB), (1, 12 * MIB)):
        loader_endpoint.publish_summary(json.dumps(SURVIVOR | {
            "rank": rank, "bytes_read_again": again}))
        await published(cluster, rank, f"gpu-{rank}")
        await eventually(lambda: kept(cluster, rank))

    lost = [{"rank": 2, "pod": "flux-2", "node": "gpu-2"}]

    def survivors() -> bool:
        """both survivors' rows name flux-2 and what each read again"""
        found = rows(cluster)
        return [(found[p].get("filledWithout"), found[p].get("bytesReadAgain"))
                for p in ("flux-0", "flux-1") if p in found] == [(lost, 8 * MIB),
                                                                 (lost, 12 * MIB)]

    await eventually(survivors)
    def warned() -> list[tuple[str, str]]:
        """each survivor's Warning is posted"""
        found = events(cluster, FILLED_WITHOUT_MEMBER)
        return found if len(found) == 2 else []

    warnings = await eventually(warned)
    assert warnings[0] == ("Warning", (
        "pod flux-0 (node gpu-0) finished its group's fill without loader rank 2 (pod flux-2, "
        "node gpu-2), lost mid-fill: it read 8.0 MiB again from the store for it (40.0 MiB "
        "from the store in all); node gpu-2 fills later, when its loader runs again"))
    assert warnings[1][1].startswith("pod flux-1 (node gpu-1) finished its group's fill "
                                     "without loader rank 2 (pod flux-2, node gpu-2)")
    assert events(cluster, REFILLED_FROM_PEERS) == []

    # flux-2's pod, back on gpu-2, fills later: from gpu-0 and gpu-1, nothing from the store.
    loader_endpoint.publish_summary(json.dumps(REFILL))
    await published(cluster, 2, "gpu-2")

    def refilled() -> list[dict[str, Any]] | None:
        """flux-2's row has the bytes from each peer"""
        return rows(cluster).get("flux-2", {}).get("bytesByPeer")

    assert await eventually(refilled) == [{"node": "gpu-0", "bytes": 80 * MIB},
                                          {"node": "gpu-1", "bytes": 40 * MIB}]
    assert await eventually(lambda: events(cluster, REFILLED_FROM_PEERS)) == [("Normal", (
        "pod flux-2 refilled node gpu-2 from the nodes that hold its entry: 120.0 MiB from "
        "peers (gpu-0 80.0 MiB, gpu-1 40.0 MiB), 0 B from the store"))]
    assert "filledWithout" not in rows(cluster)["flux-2"]
    assert len(events(cluster, FILLED_WITHOUT_MEMBER)) == 2  # posted once per survivor
