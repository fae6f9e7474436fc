"""Pods the API server refuses to create (Pod Security, a ResourceQuota, a missing PriorityClass
or ServiceAccount) are named: no pod exists to tell of them, so the operator reads the
`FailedCreate` Event their StatefulSet's or prefill Job's controller posts and reports the
refusal as the status's reason and a Warning Event, instead of `Pending: 0/2 pods created` or
`Prefilling 0/2` until the Job's deadline. The stand-in controllers refuse and post the Events
worded as the real ones (`support.kube_standin`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from support.kube_standin import KubeStandIn, standin_and_operator
from support.operator_harness import (
    DOD_PATH,
    NAMESPACE,
    ClusterEmulator,
    dod_status,
    eventually,
    request,
)
from support.rollout_specs import STORE, V1, V2

from dlo_operator.handlers import PREFILL_BACKOFF_ENV
from dlo_operator.pod_refusals import refusal

pytestmark = pytest.mark.slow  # each test runs the operator through a create

TIMEOUT = 40.0
POD_SECURITY = ('violates PodSecurity "restricted:latest": allowPrivilegeEscalation != false '
                '(container "inference" must set securityContext.allowPrivilegeEscalation=false)')
QUOTA = ("exceeded quota: gpu-team, requested: requests.cpu=1, used: requests.cpu=8, "
         "limited: requests.cpu=8")


@pytest_asyncio.fixture()
async def standin(cluster: ClusterEmulator,
                  monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[KubeStandIn]:
    monkeypatch.setenv(PREFILL_BACKOFF_ENV, "1")
    async with standin_and_operator(cluster, STORE) as fake:
        yield fake


def dod_events(cluster: ClusterEmulator, reason: str) -> list[tuple[str, str]]:
    """(type, message) of the Events on the DOD with `reason`."""
    return [(e["type"], e["message"]) for r in list(cluster) if r.resource is not None
            and r.resource.plural == "events" and r.method == "POST"
            and (e := r.data)["involvedObject"].get("kind") == "DiffusionOffloadDeployment"
            and e["reason"] == reason]


def condition(status: dict[str, Any], kind: str) -> tuple[str, str, str]:
    found = next(c for c in status["conditions"] if c["type"] == kind)
    return found["status"], found["reason"], found["message"]


async def create(cluster: ClusterEmulator) -> None:
    await request(cluster, "POST", DOD_PATH, {
        "apiVersion": "dlo.dev/v1alpha1", "kind": "DiffusionOffloadDeployment",
        "metadata": {"name": "flux", "namespace": NAMESPACE},
        "spec": {"replicas": 2, "model": {"source": V1}, "inference": {"image": "server:1"},
                 "loader": {"onRendezvousTimeout": "fail"}}})


async def ready(cluster: ClusterEmulator) -> dict[str, Any]:
    return await eventually(lambda: (s := dod_status(cluster)).get("phase") == "Ready"
                            and s.get("stage") == "Serving" and s, timeout=TIMEOUT)


async def test_workload_pods_the_api_server_refuses_are_the_reason_of_the_status(
        cluster: ClusterEmulator, standin: KubeStandIn) -> None:
    standin.refusing["StatefulSet"] = POD_SECURITY
    await create(cluster)

    message = ('pod flux-0 (not created): FailedCreate: the API server refused the pod '
               f'StatefulSet flux creates: pods "flux-0" is forbidden: {POD_SECURITY}')
    refused = await eventually(lambda: (s := dod_status(cluster)).get("message") == message
                               and s, timeout=TIMEOUT)
    assert (refused["phase"], condition(refused, "Ready")) == (
        "Pending", ("False", "FailedCreate", message))
    assert await eventually(lambda: dod_events(cluster, "FailedCreate") == [("Warning",
                                                                             message)])

    del standin.refusing["StatefulSet"]  # the platform fixed the namespace's policy
    assert (await ready(cluster))["ready"] == "2/2"


async def test_prefill_pods_the_api_server_refuses_are_named_while_the_old_pods_serve(
        cluster: ClusterEmulator, standin: KubeStandIn) -> None:
    await create(cluster)
    await ready(cluster)
    standin.refusing["Job"] = QUOTA
    await request(cluster, "PATCH", f"{DOD_PATH}/flux", {"spec": {"model": {"source": V2}}})

    stuck = await eventually(lambda: (s := dod_status(cluster)).get("stage") == "Prefilling"
                             and "FailedCreate" in s.get("stageMessage", "") and s,
                             timeout=TIMEOUT)
    job = f"flux-prefill-{stuck['revision']}"
    status, reason, message = condition(stuck, "Prefilled")
    assert (status, reason) == ("False", "PrefillStuck")
    assert message.startswith(f"prefill of revision {stuck['revision']} is stuck: pod {job}-0-")
    assert message.endswith(f"(not created): FailedCreate: the API server refused the pod Job "
                            f"{job} creates: pods \"{job}-0-{message.split(job + '-0-')[1][:5]}"
                            f"\" is forbidden: {QUOTA}; the old pods keep serving")
    assert (stuck["phase"], condition(stuck, "Available")[0]) == ("Updating", "True")
    assert await eventually(lambda: dod_events(cluster, "PrefillStuck") == [("Warning",
                                                                             message)])

    del standin.refusing["Job"]  # the quota was raised
    done = await eventually(lambda: (s := dod_status(cluster)).get("phase") == "Ready" and (
        s.get("prefill") or {}).get("state") == "Succeeded" and s, timeout=TIMEOUT)
    assert done["revision"] == stuck["revision"]


def test_a_refusal_is_over_once_a_pod_was_created_after_it() -> None:
    """The controller's latest FailedCreate counts while no pod of it was created since; another
    Job's (an earlier attempt's) Events do not count."""
    job = {"kind": "Job", "metadata": {"name": "flux-prefill-abc", "uid": "uid-2"}}
    event = {"reason": "FailedCreate", "lastTimestamp": "2026-12-01T09:00:00Z",
             "involvedObject": {"kind": "Job", "name": "flux-prefill-abc", "uid": "uid-2"},
             "message": f'Error creating: pods "flux-prefill-abc-1-x" is forbidden: {QUOTA}'}
    earlier = {"metadata": {"name": "flux-prefill-abc-0-y",
                            "creationTimestamp": "2026-12-01T09:00:00Z"}}
    later = {"metadata": {"name": "flux-prefill-abc-1-x",
                          "creationTimestamp": "2026-12-01T09:00:01Z"}}
    refused = refusal(job, [event], [earlier])
    assert refused is not None and refused.message == (
        "pod flux-prefill-abc-1-x (not created): FailedCreate: the API server refused the pod "
        f'Job flux-prefill-abc creates: pods "flux-prefill-abc-1-x" is forbidden: {QUOTA}')
    assert refusal(job, [event], [earlier, later]) is None
    other = {**event, "involvedObject": {**event["involvedObject"], "uid": "uid-1"}}
    assert refusal(job, [other], []) is None
