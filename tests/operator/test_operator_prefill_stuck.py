"""A hung prefill loader is named within minutes, not after the Job's deadline an hour on: a
prefill loader that shows no progress (no byte written, no change of phase, on its real metrics
endpoint) for `spec.loader.progressDeadlineSeconds` makes the prefill `PrefillStuck`, naming the
pod, the node and what the loader waits for, with a Warning Event; progress clears it. A Job
that runs out of time names the nodes whose loader had not finished. The operator's clock is
moved past the deadline instead of waiting for it."""

from __future__ import annotations

import datetime
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import pytest_asyncio
from dlo_loader import metrics as loader_metrics
from dlo_loader.progress import Progress
from support.kube_standin import JOBS_PATH, KubeStandIn, standin_and_operator
from support.operator_harness import (
    DOD_PATH,
    NAMESPACE,
    PODS_PATH,
    ClusterEmulator,
    ShiftedClock,
    dod_status,
    eventually,
    request,
)
from support.rollout_specs import STORE, V1, V2

from dlo_operator import progress
from dlo_operator.handlers import PREFILL_BACKOFF_ENV
from dlo_operator.prefill_watch import no_progress

pytestmark = pytest.mark.slow  # the operator through a create and a model change

DEADLINE_S = 300
TIMEOUT = 40.0


@pytest.fixture
def loader() -> Iterator[tuple[int, Progress]]:
    """A prefill loader's real metrics endpoint: waiting for its group, nothing written."""
    fill = Progress(total_bytes=1200, prefix="")
    fill.phase = "waiting"
    loader_metrics.FILL.attach(fill)
    endpoint = loader_metrics.Endpoint(0, addr="127.0.0.1")
    try:
        yield endpoint.port, fill
    finally:
        endpoint.close()


@pytest_asyncio.fixture()
async def standin(cluster: ClusterEmulator, clock: ShiftedClock,
                  monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[KubeStandIn]:
    monkeypatch.setenv(PREFILL_BACKOFF_ENV, "600")
    async with standin_and_operator(cluster, STORE, clock) as fake:
        yield fake


def prefilled(cluster: ClusterEmulator) -> dict[str, Any]:
    return next((c for c in dod_status(cluster).get("conditions", ())
                 if c["type"] == "Prefilled"), {})


def warnings(cluster: ClusterEmulator, reason: str) -> list[str]:
    return [e["message"] for r in list(cluster) if r.resource is not None
            and r.resource.plural == "events" and r.method == "POST"
            and (e := r.data)["involvedObject"].get("kind") == "DiffusionOffloadDeployment"
            and e["reason"] == reason and e["type"] == "Warning"]


async def test_a_prefill_loader_without_progress_is_named_with_what_it_waits_for(
        cluster: ClusterEmulator, standin: KubeStandIn, clock: ShiftedClock,
        loader: tuple[int, Progress]) -> None:
    port, fill = loader
    await request(cluster, "POST", DOD_PATH, {
        "apiVersion": "dlo.dev/v1alpha1", "kind": "DiffusionOffloadDeployment",
        "metadata": {"name": "flux", "namespace": NAMESPACE},
        "spec": {"replicas": 2, "model": {"source": V1}, "inference": {"image": "server:1"},
                 "loader": {"onRendezvousTimeout": "fail", "metricsPort": port}}})
    await eventually(lambda: dod_status(cluster).get("phase") == "Ready", timeout=TIMEOUT)
    standin.hold_prefill = True  # the prefill loaders start and hang
    await request(cluster, "PATCH", f"{DOD_PATH}/flux", {"spec": {"model": {"source": V2}}})
    running = await eventually(lambda: [n["loader"] for n in (dod_status(cluster).get(
        "prefill") or {}).get("nodes", [])] == ["Running", "Running"] and dod_status(cluster),
        timeout=TIMEOUT)
    pods = [n["pod"] for n in running["prefill"]["nodes"]]
    for pod in pods:  # the kubelet gives each pod its address: its loader's endpoint
        await request(cluster, "PATCH", f"{PODS_PATH}/{pod}/status",
                      {"status": {"podIP": "127.0.0.1"}})
    seen = await eventually(lambda: len((dod_status(cluster).get("progress") or {}).get(
        "nodes", [])) == 2 and dod_status(cluster)["progress"], timeout=TIMEOUT)
    assert prefilled(cluster)["reason"] == "Prefilling"

    clock.offset = datetime.timedelta(seconds=DEADLINE_S + 1)
    stuck = await eventually(lambda: prefilled(cluster).get("reason") == "PrefillStuck"
                             and prefilled(cluster), timeout=TIMEOUT)
    since = seen["nodes"][0]["progressAt"]
    message = (f"prefill of revision {running['revision']} is stuck: loader container of pod "
               f"{pods[0]} on node gpu-0: NoProgress: no progress since {since} (more than "
               f"spec.loader.progressDeadlineSeconds={DEADLINE_S} s): waiting for its node's "
               "cache lock or the other loaders of its group (the rendezvous) (phase waiting, "
               "0 B of 1.2 KiB written); the old pods keep serving")
    assert (stuck["status"], stuck["message"]) == ("False", message)
    assert dod_status(cluster)["stageMessage"] == message
    assert await eventually(lambda: warnings(cluster, "PrefillStuck") == [message])

    fill.phase = "transferring"  # the loaders move again
    fill.add(written=600)
    await eventually(lambda: prefilled(cluster).get("reason") == "Prefilling", timeout=TIMEOUT)

    job = f"flux-prefill-{running['revision']}"
    await request(cluster, "PATCH", f"{JOBS_PATH}/{job}/status", {"status": {"conditions": [{
        "type": "Failed", "status": "True", "reason": "DeadlineExceeded",
        "message": "Job was active longer than specified deadline"}]}})
    failed = await eventually(lambda: (dod_status(cluster).get("prefill") or {}).get(
        "state") == "Failed" and dod_status(cluster)["prefill"], timeout=TIMEOUT)
    assert failed["message"] == (
        "Job DeadlineExceeded: Job was active longer than specified deadline; not finished on "
        f"gpu-0 (pod {pods[0]}, loader Running), gpu-1 (pod {pods[1]}, loader Running)")


def test_a_loader_that_stops_answering_keeps_the_time_it_last_moved() -> None:
    """A hung loader may stop answering its endpoint too: its row stays, with the time it last
    moved, while its pod runs; a loader whose endpoint never answered is not judged."""
    pod = {"metadata": {"name": "flux-prefill-0"}, "spec": {"nodeName": "gpu-0"},
           "status": {"containerStatuses": [{"name": "loader", "state": {"running": {
               "startedAt": "2026-12-01T08:00:00Z"}}}]}}
    reading = progress.LoaderReading(bytes_done=600, bytes_total=1200, bytes_per_second=0.0,
                                     stalled=False, phase="waiting")
    first = progress.progress_status([(pod, reading)], now="2026-12-01T09:00:00Z")
    again = progress.progress_status([], previous=first, now="2026-12-01T09:10:00Z",
                                     running=[pod])
    assert again is not None and again["nodes"] == first["nodes"]
    assert again["nodes"][0]["progressAt"] == "2026-12-01T09:00:00Z"
    at = datetime.datetime(2026, 12, 1, 9, 10, tzinfo=datetime.timezone.utc)
    stuck = no_progress([pod], again, at, DEADLINE_S)
    assert stuck is not None and stuck.message.startswith(
        "loader container of pod flux-prefill-0 on node gpu-0: NoProgress: no progress since "
        "2026-12-01T09:00:00Z")
    assert no_progress([pod], {}, at, DEADLINE_S) is None  # never answered: not judged
    assert progress.progress_status([], previous=first, running=[]) is None
