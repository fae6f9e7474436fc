"""A `helm upgrade` that changes the operator's default loader image restarts no serving pod by
itself: pods of a DOD that names no loader image keep the image their StatefulSet holds until
the pod template changes anyway (the chart's `loaderImageUpdate: OnSpecChange`), or roll onto it
at once where the platform (`Rolling`) or the DOD's annotation asks. Pods that restart into
another loader image get an Event, and the status names the image while they roll. The operator
runs as `dlo operator run` starts it, with the chart's values; the upgrade is a restart with
other values while the stand-in's StatefulSet controller (which rolls any template change) runs
on."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import kopf
import pytest
from support.kube_standin import KubeStandIn
from support.operator_harness import (
    DOD_PATH,
    NAMESPACE,
    ClusterEmulator,
    dod_status,
    eventually,
    live,
    operator_with,
    request,
)

from dlo_operator.installation import InstallationConfig, LoaderImageUpdate

pytestmark = pytest.mark.slow  # the operator through a create, an upgrade and a restart

V1 = "s3://models/flux-v1/"
IMAGE = "registry.example.com/dlo-loader:{}"
TIMEOUT = 40.0
KEEPS_THE_ENTRY = {"offload": {"useAllgather": False, "residentLayers": 2}}


def chart(tag: str, update: LoaderImageUpdate = LoaderImageUpdate.ON_SPEC_CHANGE) -> kopf.Memo:
    return kopf.Memo(installation=InstallationConfig(loader_image=IMAGE.format(tag),
                                                     loader_image_update=update))


@contextlib.asynccontextmanager
async def serving(cluster: ClusterEmulator) -> AsyncIterator[KubeStandIn]:
    """A DOD of two pods created under the chart's loader image 1; the stand-in runs on."""
    fake = KubeStandIn(cluster, nodes=["gpu-0", "gpu-1"], store={V1: 1000})
    task = asyncio.create_task(fake.run())
    try:
        async with operator_with(chart("1")):
            await request(cluster, "POST", DOD_PATH, {
                "apiVersion": "dlo.dev/v1alpha1", "kind": "DiffusionOffloadDeployment",
                "metadata": {"name": "flux", "namespace": NAMESPACE},
                "spec": {"replicas": 2, "model": {"source": V1},
                         "inference": {"image": "server:1"}}})
            await ready(cluster)
        yield fake
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def ready(cluster: ClusterEmulator, revision: str = "") -> dict[str, Any]:
    return await eventually(lambda: (s := dod_status(cluster)).get("phase") == "Ready"
                            and s.get("stage") == "Serving" and s.get("updatedReplicas") == 2
                            and s.get("revision") == (revision or s["revision"]) and s,
                            timeout=TIMEOUT)


def pods(standin: KubeStandIn) -> dict[str, tuple[str, str]]:
    """Workload pod name -> (uid, loader image)."""
    return {p["metadata"]["name"]: (p["metadata"]["uid"], p["spec"]["initContainers"][0]["image"])
            for p in standin.pods() if "dlo.dev/role" not in p["metadata"]["labels"]}


def template_image(cluster: ClusterEmulator) -> str:
    sts = live(cluster, "apps/v1/statefulsets", "flux") or {}
    return sts["spec"]["template"]["spec"]["initContainers"][0]["image"]


def image_events(cluster: ClusterEmulator) -> list[str]:
    return [e["message"] for r in list(cluster) if r.resource is not None
            and r.resource.plural == "events" and r.method == "POST"
            and (e := r.data)["reason"] == "LoaderImageChanged"]


def status_messages(cluster: ClusterEmulator) -> list[str]:
    return [r.data["status"].get("message", "") for r in list(cluster)
            if r.resource is not None and r.subresource == "status" and r.method == "PATCH"
            and r.resource.plural == "diffusionoffloaddeployments"
            and "status" in (r.data or {})]


async def test_an_upgrade_keeps_the_pods_loader_image_until_the_spec_changes(
        cluster: ClusterEmulator) -> None:
    async with serving(cluster) as standin:
        before = pods(standin)
        async with operator_with(chart("2")):  # helm upgrade: a new default loader image
            kept = await eventually(lambda: "kept" in dod_status(cluster).get(
                "stageMessage", "") and dod_status(cluster), timeout=TIMEOUT)
            assert kept["stageMessage"] == (
                f"serving revision {kept['revision']}; loader image {IMAGE.format(1)} kept, the "
                f"operator's default is now {IMAGE.format(2)}: the pods take it when their "
                "template changes (loaderImageUpdate OnSpecChange; the annotation "
                "dlo.dev/loader-image-update: Rolling takes it now)")
            await eventually(lambda: len(status_messages(cluster)) > 0)
            reads = len(list(cluster))
            await eventually(lambda: len(list(cluster)) > reads + 20)  # it reconciled on
            assert template_image(cluster) == IMAGE.format(1)
            assert pods(standin) == before and image_events(cluster) == []

            await request(cluster, "PATCH", f"{DOD_PATH}/flux", {"spec": KEEPS_THE_ENTRY})
            changed = await eventually(lambda: (rev := dod_status(cluster).get("revision"))
                                       != kept["revision"] and rev, timeout=TIMEOUT)
            await ready(cluster, changed)
            await eventually(lambda: {image for _, image in pods(standin).values()} == {
                IMAGE.format(2)}, timeout=TIMEOUT)
            assert image_events(cluster) == [
                f"the pods restart with loader image {IMAGE.format(2)} (was {IMAGE.format(1)}): "
                "the pod template changed with the spec and takes the operator's default "
                f"loader image {IMAGE.format(2)} along (chart value loaderImageUpdate is "
                "OnSpecChange)"]


@pytest.mark.parametrize("asked_by", ["chart value loaderImageUpdate",
                                      "annotation dlo.dev/loader-image-update"])
async def test_rolling_restarts_the_pods_onto_the_new_default_and_says_so(
        cluster: ClusterEmulator, asked_by: str) -> None:
    async with serving(cluster) as standin:
        before = pods(standin)
        if asked_by.startswith("annotation"):
            await request(cluster, "PATCH", f"{DOD_PATH}/flux", {"metadata": {"annotations": {
                "dlo.dev/loader-image-update": "Rolling"}}})
            upgrade = chart("2")
        else:
            upgrade = chart("2", LoaderImageUpdate.ROLLING)
        async with operator_with(upgrade):
            await eventually(lambda: {image for _, image in pods(standin).values()} == {
                IMAGE.format(2)}, timeout=TIMEOUT)
            await ready(cluster)
            assert {uid for uid, _ in pods(standin).values()}.isdisjoint(
                uid for uid, _ in before.values())
            assert image_events(cluster) == [
                f"the pods restart with loader image {IMAGE.format(2)} (was {IMAGE.format(1)}): "
                f"the operator's default loader image is {IMAGE.format(2)} and {asked_by} is "
                "Rolling"]
            assert any(m.startswith(f"rolling update to loader image {IMAGE.format(2)}: 0/2 "
                                    "pods updated") for m in status_messages(cluster))


async def test_a_bad_annotation_is_refused_naming_it(cluster: ClusterEmulator) -> None:
    async with serving(cluster):
        async with operator_with(chart("1")):
            await request(cluster, "PATCH", f"{DOD_PATH}/flux", {"metadata": {"annotations": {
                "dlo.dev/loader-image-update": "Always"}}})
            refused = await eventually(lambda: dod_status(cluster).get("phase") == "Failed"
                                       and dod_status(cluster), timeout=TIMEOUT)
            assert refused["message"] == (
                "metadata.annotations[dlo.dev/loader-image-update]='Always' is not one of "
                "OnSpecChange, Rolling; remove it to follow the chart value loaderImageUpdate")
