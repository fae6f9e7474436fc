"""Every prefill that starts ends with exactly one of PrefillSucceeded, PrefillFailed or
PrefillSuperseded, whatever the spec does meanwhile: checked over the DOD's Events in order
(one prefill at a time: each `PrefillStarted` is followed by its end before the next starts),
with the operator against the API emulator and the stand-in controllers and kubelet. A settings
edit that keeps the entry, made during a failed prefill's backoff, continues that prefill: the
backoff, the attempt count and the failure's reason carry over. The operator's clock is moved
past the backoff instead of waiting for it."""

from __future__ import annotations

import datetime
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from support.kube_standin import KubeStandIn, standin_and_operator
from support.operator_harness import (
    DOD_PATH,
    NAMESPACE,
    ClusterEmulator,
    ShiftedClock,
    dod_status,
    eventually,
    request,
)

from dlo_operator.handlers import PREFILL_BACKOFF_ENV

pytestmark = pytest.mark.slow  # each test runs the operator through model changes

V1, V2, V3 = "s3://models/flux-v1/", "s3://models/flux-v2/", "s3://models/flux-v3/"
STORE = {V1: 1000, V2: 1200, V3: 1400}
KEEPS_THE_ENTRY = {"offload": {"useAllgather": False, "residentLayers": 2}}
BACKOFF_S = 600
TIMEOUT = 40.0
ENDS = ("PrefillSucceeded", "PrefillFailed", "PrefillSuperseded")


@pytest_asyncio.fixture()
async def standin(cluster: ClusterEmulator, clock: ShiftedClock,
                  monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[KubeStandIn]:
    monkeypatch.setenv(PREFILL_BACKOFF_ENV, str(BACKOFF_S))
    async with standin_and_operator(cluster, STORE, clock) as fake:
        yield fake


def prefill_events(cluster: ClusterEmulator) -> list[tuple[str, str]]:
    """(reason, revision) of the DOD's prefill Events, in the order they were posted."""
    found = [r.data for r in list(cluster) if r.resource is not None
             and r.resource.plural == "events" and r.method == "POST"]
    return [(e["reason"], re.search(r"revision ([0-9a-f]+)", e["message"]).group(1))
            for e in found if e.get("involvedObject", {}).get("name") == "flux"
            and e["reason"].startswith("Prefill") and e["reason"] != "PrefillStuck"]


def assert_each_prefill_ends_once(events: list[tuple[str, str]]) -> None:
    running: str | None = None
    for reason, rev in events:
        if reason == "PrefillStarted":
            assert running is None, f"{rev} started while {running} had not ended: {events}"
            running = rev
        elif reason in ENDS:
            assert running == rev, f"{reason} of {rev}, but {running} runs: {events}"
            running = None
        else:
            assert running is None, f"{reason} of {rev} while {running} runs: {events}"
    assert running is None, f"{running} never ended: {events}"


async def serving(cluster: ClusterEmulator) -> dict[str, Any]:
    await request(cluster, "POST", DOD_PATH, {
        "apiVersion": "dlo.dev/v1alpha1", "kind": "DiffusionOffloadDeployment",
        "metadata": {"name": "flux", "namespace": NAMESPACE},
        "spec": {"replicas": 2, "model": {"source": V1}, "inference": {"image": "server:1"},
                 "loader": {"onRendezvousTimeout": "fail"}}})
    return await ready(cluster)


async def ready(cluster: ClusterEmulator, revision: str = "") -> dict[str, Any]:
    return await eventually(lambda: (s := dod_status(cluster)).get("phase") == "Ready" and s.get(
        "stage") == "Serving" and s.get("revision") == (revision or s.get("revision")) and s,
        timeout=TIMEOUT)


async def patch_spec(cluster: ClusterEmulator, spec: dict[str, Any]) -> str:
    """The new revision, once the operator took the change."""
    before = dod_status(cluster).get("revision")
    await request(cluster, "PATCH", f"{DOD_PATH}/flux", {"spec": spec})
    return await eventually(lambda: (rev := dod_status(cluster).get("revision")) != before
                            and rev, timeout=TIMEOUT)


def prefill(cluster: ClusterEmulator) -> dict[str, Any]:
    return dod_status(cluster).get("prefill") or {}


async def test_a_change_during_a_prefill_ends_that_prefill_superseded(
        cluster: ClusterEmulator, standin: KubeStandIn) -> None:
    await serving(cluster)
    standin.hold_prefill = True
    second = await patch_spec(cluster, {"model": {"source": V2}})
    await eventually(lambda: [n["loader"] for n in prefill(cluster).get("nodes", [])] == [
        "Running", "Running"], timeout=TIMEOUT)

    third = await patch_spec(cluster, {"model": {"source": V3}})
    standin.hold_prefill = False
    await ready(cluster, third)

    await eventually(lambda: prefill_events(cluster)[-1] == ("PrefillSucceeded", third))
    assert prefill_events(cluster) == [("PrefillStarted", second), ("PrefillSuperseded", second),
                                       ("PrefillStarted", third), ("PrefillSucceeded", third)]
    assert_each_prefill_ends_once(prefill_events(cluster))


async def test_a_settings_edit_during_a_backoff_continues_the_failed_prefill(
        cluster: ClusterEmulator, standin: KubeStandIn, clock: ShiftedClock) -> None:
    await serving(cluster)
    standin.failing[V2] = "s3://models/flux-v2/ not readable: 403 AccessDenied"
    second = await patch_spec(cluster, {"model": {"source": V2}})
    failed = await eventually(lambda: prefill(cluster).get("state") == "Failed"
                              and prefill(cluster), timeout=TIMEOUT)

    edited = await patch_spec(cluster, KEEPS_THE_ENTRY)
    carried = await eventually(lambda: prefill(cluster).get("revision") == edited
                               and dod_status(cluster), timeout=TIMEOUT)
    assert carried["stage"] == "Backoff"
    assert {key: carried["prefill"][key] for key in ("state", "attempt", "retryAt", "message")} == {
        key: failed[key] for key in ("state", "attempt", "retryAt", "message")}
    assert prefill_events(cluster) == [("PrefillStarted", second), ("PrefillFailed", second)]

    del standin.failing[V2]
    clock.offset = datetime.timedelta(seconds=BACKOFF_S + 1)
    done = await ready(cluster, edited)
    assert (done["prefill"]["state"], done["prefill"]["attempt"]) == ("Succeeded", 2)
    await eventually(lambda: prefill_events(cluster)[-1] == ("PrefillSucceeded", edited))
    assert prefill_events(cluster)[2:] == [("PrefillStarted", edited), ("PrefillSucceeded", edited)]
    assert_each_prefill_ends_once(prefill_events(cluster))


async def test_a_reverted_model_cancels_the_retry_of_its_failed_prefill(
        cluster: ClusterEmulator, standin: KubeStandIn) -> None:
    first = await serving(cluster)
    standin.failing[V2] = "s3://models/flux-v2/ not readable: 403 AccessDenied"
    second = await patch_spec(cluster, {"model": {"source": V2}})
    await eventually(lambda: prefill(cluster).get("state") == "Failed", timeout=TIMEOUT)

    await patch_spec(cluster, {"model": {"source": V1}})
    await ready(cluster, first["revision"])

    await eventually(lambda: prefill_events(cluster)[-1][0] == "PrefillRetryCancelled")
    assert prefill_events(cluster) == [("PrefillStarted", second), ("PrefillFailed", second),
                                       ("PrefillRetryCancelled", second)]
    assert_each_prefill_ends_once(prefill_events(cluster))
