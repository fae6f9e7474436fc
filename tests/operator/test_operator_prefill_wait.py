"""A prefill Job reported complete while a node's loader still reports `Running`: the view of
that pod lags the Job's (an Indexed Job completes only once every index succeeded), so the
operator keeps the old pods serving and waits for the loader to end, however long ago the Job
completed; only summaries of pods the view no longer shows are given up after the grace
period."""

from __future__ import annotations

import datetime
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from support.kube_standin import JOBS_PATH, KubeStandIn
from support.operator_harness import (
    DOD_PATH,
    NAMESPACE,
    ClusterEmulator,
    dod_status,
    eventually,
    live,
    operator_beside,
    request,
)
from support.rollout_specs import NEW, NODES, NOW, OLD, OWNER, STORE, V1, V2

from dlo_contract.documents import FillStatus, FillSummary
from dlo_operator.configmap import revision
from dlo_operator.decision import Observed, Stage
from dlo_operator.handlers import PREFILL_BACKOFF_ENV
from dlo_operator.manifests import build_children
from dlo_operator.naming import LABEL_JOB_INDEX, LABEL_REVISION, LOADER_CONTAINER
from dlo_operator.prefill_stage import SUMMARY_GRACE_S, BackoffConfig
from dlo_operator.rollout import decide


def _job_pod(index: int, state: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": f"flux-prefill-{index}",
                         "labels": {LABEL_REVISION: revision(NEW), LABEL_JOB_INDEX: str(index)}},
            "spec": {"nodeName": NODES[index]},
            "status": {"containerStatuses": [{"name": LOADER_CONTAINER, "state": state}]}}


def _filled(index: int) -> dict[str, Any]:
    summary = FillSummary(status=FillStatus.OK, rank=index, world_size=2, entry_id="e",
                          mode="multi-reader", bytes_from_store=600, bytes_from_peers=600,
                          bytes_to_peers=600, seconds=1.0, cached=False)
    return _job_pod(index, {"terminated": {"exitCode": 0, "message": summary.to_json()}})


def _seen(completed_s_ago: float) -> Observed:
    done = NOW - datetime.timedelta(seconds=completed_s_ago)
    job = {"metadata": {"name": OWNER.prefill_name(revision(NEW))}, "spec": {"completions": 2},
           "status": {"conditions": [{"type": "Complete", "status": "True"}],
                      "completionTime": done.strftime("%Y-%m-%dT%H:%M:%SZ")}}
    serving = [{"metadata": {"name": f"flux-{i}", "labels": {}}, "spec": {"nodeName": node}}
               for i, node in enumerate(NODES)]
    return Observed(statefulset=build_children(OWNER, OLD)[3], pods=serving, group=None,
                    jobs=[job], job_pods=[_filled(0), _job_pod(1, {"running": {}})],
                    settings_configmaps=[], prefill={"revision": revision(NEW), "attempt": 1},
                    now=NOW)


@pytest.mark.parametrize("completed_s_ago", [1.0, SUMMARY_GRACE_S + 1, 3600.0])
def test_a_complete_job_with_a_running_loader_is_waited_for(completed_s_ago: float) -> None:
    decision = decide(OWNER, NEW, _seen(completed_s_ago), BackoffConfig())
    assert decision.stage is Stage.PREFILLING
    assert decision.message == (f"prefill of revision {revision(NEW)} succeeded; waiting for "
                                "the loaders' summaries (1/2)")
    assert [n["loader"] for n in decision.prefill["nodes"]] == ["Cached", "Running"]
    assert decision.prefill["state"] == "Running" and not decision.reports
    assert ("Job", OWNER.prefill_name(revision(NEW))) not in decision.delete


@pytest_asyncio.fixture()
async def standin(cluster: ClusterEmulator,
                  monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[KubeStandIn]:
    monkeypatch.setenv(PREFILL_BACKOFF_ENV, "1")
    fake = KubeStandIn(cluster, nodes=["gpu-0", "gpu-1"], store=dict(STORE))
    async with operator_beside(fake.run()):
        yield fake


def _serving(standin: KubeStandIn) -> dict[str, str]:
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in standin.pods()
            if p["metadata"]["labels"].get("dlo.dev/role") is None}


@pytest.mark.slow  # the operator through a create and a model change
async def test_the_operator_waits_for_a_running_loader_of_a_job_reported_complete(
        cluster: ClusterEmulator, standin: KubeStandIn) -> None:
    await request(cluster, "POST", DOD_PATH, {
        "apiVersion": "dlo.dev/v1alpha1", "kind": "DiffusionOffloadDeployment",
        "metadata": {"name": "flux", "namespace": NAMESPACE},
        "spec": {"replicas": 2, "model": {"source": V1}, "inference": {"image": "server:1"},
                 "loader": {"onRendezvousTimeout": "fail"}}})
    await eventually(lambda: dod_status(cluster).get("phase") == "Ready", timeout=40)
    serving = _serving(standin)
    standin.hold_prefill = True  # the prefill loaders start and keep running
    await request(cluster, "PATCH", f"{DOD_PATH}/flux", {"spec": {"model": {"source": V2}}})
    running = await eventually(lambda: [n["loader"] for n in (dod_status(cluster).get(
        "prefill") or {}).get("nodes", [])] == ["Running", "Running"] and dod_status(cluster),
        timeout=40)
    job = f"flux-prefill-{running['revision']}"
    long_ago = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(
        seconds=SUMMARY_GRACE_S * 2)  # past the grace period for summaries that never come
    await request(cluster, "PATCH", f"{JOBS_PATH}/{job}/status", {"status": {
        "conditions": [{"type": "Complete", "status": "True", "reason": "Completed"}],
        "completionTime": long_ago.strftime("%Y-%m-%dT%H:%M:%SZ")}})

    waiting = await eventually(lambda: dod_status(cluster).get("stageMessage", "").endswith(
        "succeeded; waiting for the loaders' summaries (0/2)") and dod_status(cluster), timeout=40)
    assert waiting["stage"] == "Prefilling" and waiting["prefill"]["state"] == "Running"
    assert _serving(standin) == serving  # the old pods serve on
    assert live(cluster, "batch/v1/jobs", job) is not None

    standin.hold_prefill = False  # the loaders end and report their summaries
    done = await eventually(lambda: dod_status(cluster).get("phase") == "Ready" and dod_status(
        cluster).get("revision") == running["revision"] and (dod_status(cluster).get(
            "prefill") or {}).get("state") == "Succeeded" and dod_status(cluster), timeout=40)
    assert done["prefill"]["bytesFromStore"] == STORE[V2]
    assert [n["loader"] for n in done["prefill"]["nodes"]] == ["Cached", "Cached"]
