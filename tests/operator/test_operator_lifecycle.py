"""Day two end to end: kopf's runner against the API emulator, with the stand-in StatefulSet and
Job controllers and kubelet of `support.kube_standin` (a model of each node's cache and of the
loader protocol, counting every byte read from the store).

Each test prints what `kubectl get dod` and the Events would show at its milestones (`-s`)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from support.kube_standin import KubeStandIn
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
from support.rollout_specs import STORE, V1, V2

from dlo_operator.handlers import PREFILL_BACKOFF_ENV

pytestmark = pytest.mark.slow  # each test runs the operator through a whole rollout

STS_PATH = f"/apis/apps/v1/namespaces/{NAMESPACE}/statefulsets"
TIMEOUT = 40.0


def dod(replicas: int = 2, source: str = V1) -> dict[str, Any]:
    return {"apiVersion": "dlo.dev/v1alpha1", "kind": "DiffusionOffloadDeployment",
            "metadata": {"name": "flux", "namespace": NAMESPACE},
            "spec": {"replicas": replicas, "model": {"source": source},
                     "loader": {"onRendezvousTimeout": "fail"},
                     "inference": {"image": "server:1"}}}


@pytest_asyncio.fixture()
async def standin(cluster: ClusterEmulator,
                  monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[KubeStandIn]:
    monkeypatch.setenv(PREFILL_BACKOFF_ENV, "1")
    fake = KubeStandIn(cluster, nodes=[f"gpu-{i}" for i in range(5)], store=dict(STORE))
    async with operator_beside(fake.run()):
        yield fake


def kubectl_get_dod(cluster: ClusterEmulator, when: str) -> str:
    """The row `kubectl get dod` prints (the CRD's printer columns), with a label."""
    s = dod_status(cluster)
    row = (f"{'flux':<6} {s.get('phase', ''):<9} {s.get('ready', ''):<6} {s.get('cache', ''):<6} "
           f"{s.get('revision', ''):<11} {s.get('stage', '')}")
    print(f"\n[{when}] NAME   PHASE     READY  CACHE  REVISION    STAGE\n[{when}] {row}"
          f"\n[{when}] stage: {s.get('stageMessage')}\n[{when}] prefill: "
          f"{json.dumps(s.get('prefill'))}")
    return row


def events(cluster: ClusterEmulator) -> list[dict[str, Any]]:
    found = [r.data for r in list(cluster) if r.resource is not None
             and r.resource.plural == "events" and r.method == "POST"]
    return [e for e in found if e.get("involvedObject", {}).get("name") == "flux"]


def print_events(cluster: ClusterEmulator, when: str) -> None:
    for event in events(cluster):
        print(f"[{when}] Event {event.get('type')} {event.get('reason')}: {event.get('message')}")


def uids(standin: KubeStandIn, *names: str) -> dict[str, str]:
    pods = {p["metadata"]["name"]: p["metadata"]["uid"] for p in standin.pods()}
    return {name: pods.get(name, "") for name in names}


def template_revision(cluster: ClusterEmulator) -> str:
    sts = live(cluster, "apps/v1/statefulsets", "flux")
    return sts["spec"]["template"]["metadata"]["annotations"]["dlo.dev/revision"] if sts else ""


def settings_maps(cluster: ClusterEmulator) -> list[str]:
    return sorted(key[2] for key, obj in cluster.objects.items()
                  if key[0].plural == "configmaps" and not obj.deleted
                  and key[2].startswith("flux-settings-"))


async def ready(cluster: ClusterEmulator, pods: int, revision: str = "",
                timeout: float = TIMEOUT) -> dict[str, Any]:
    """The status says `pods` Ready pods, all of the spec's revision (`revision`, when given)."""
    def check() -> dict[str, Any] | None:
        s = dod_status(cluster)
        return s if (s.get("phase") == "Ready" and s.get("stage") == "Serving"
                     and s.get("readyReplicas") == s.get("updatedReplicas") == pods
                     and s.get("revision") == (revision or s.get("revision"))) else None
    return await eventually(check, timeout=timeout)


def revisions(standin: KubeStandIn) -> list[str]:
    """The revision of each workload pod, as the stand-in's StatefulSet controller made it."""
    return [p["metadata"]["annotations"]["dlo.dev/revision"] for p in standin.pods()
            if p["metadata"]["labels"].get("dlo.dev/role") is None]


async def create(cluster: ClusterEmulator, standin: KubeStandIn,
                 replicas: int = 2) -> dict[str, Any]:
    await request(cluster, "POST", DOD_PATH, dod(replicas))
    return await ready(cluster, replicas)


async def patch_spec(cluster: ClusterEmulator, spec: dict[str, Any]) -> None:
    await request(cluster, "PATCH", f"{DOD_PATH}/flux", {"spec": spec})


async def test_create_fills_every_node_as_one_group(
        cluster: ClusterEmulator, standin: KubeStandIn) -> None:
    s = await create(cluster, standin)
    kubectl_get_dod(cluster, "create")

    assert [(f.pod, f.rank, f.world, f.bytes_from_store) for f in standin.fills] == [
        ("flux-0", 0, 2, 500), ("flux-1", 1, 2, 500)]
    assert standin.store_bytes == STORE[V1] and standin.rendezvous_timeouts == []
    assert (s["ready"], s["cache"], s.get("prefill")) == ("2/2", "2/2", None)
    assert [n["loader"] for n in s["nodes"]] == ["Cached", "Cached"]
    settings = live(cluster, "v1/configmaps", f"flux-settings-{s['revision']}")
    assert settings["immutable"] is True
    group = json.loads(live(cluster, "v1/configmaps", "flux-fill-group")["data"]["group.json"])
    assert group["members"] == {}  # closed once both members finished


async def test_model_change_prefills_while_old_pods_serve_then_restarts_cached(
        cluster: ClusterEmulator, standin: KubeStandIn) -> None:
    first = await create(cluster, standin)
    old = uids(standin, "flux-0", "flux-1")
    standin.hold_prefill = True
    before = standin.store_bytes

    await patch_spec(cluster, {"model": {"source": V2}})

    prefilling = await eventually(lambda: dod_status(cluster).get("stage") == "Prefilling" and [
        n["loader"] for n in (dod_status(cluster).get("prefill") or {}).get("nodes", [])] == [
        "Running", "Running"] and dod_status(cluster), timeout=TIMEOUT)
    kubectl_get_dod(cluster, "model change, prefilling")
    assert prefilling["phase"] == "Updating"
    # The old pods serve; the spec's revision is not Ready, and the rollout says where it is.
    assert {c["type"]: (c["status"], c["reason"]) for c in prefilling["conditions"]
            if c["type"] in ("Available", "Progressing", "Ready")} == {
        "Available": ("True", "ReplicasReady"), "Progressing": ("True", "Prefilling"),
        "Ready": ("False", "Prefilling")}
    assert [(n["node"], n["loader"]) for n in prefilling["prefill"]["nodes"]] == [
        ("gpu-0", "Running"), ("gpu-1", "Running")]
    assert uids(standin, "flux-0", "flux-1") == old
    assert template_revision(cluster) == first["revision"]

    standin.hold_prefill = False
    s = await ready(cluster, 2, revision=prefilling["revision"])
    kubectl_get_dod(cluster, "model change, rolled")

    prefill_fills = [f for f in standin.fills if f.pod.startswith("flux-prefill-")]
    restart_fills = [f for f in standin.fills[2:] if not f.pod.startswith("flux-prefill-")]
    assert sorted((f.rank, f.world, f.bytes_from_store) for f in prefill_fills) == [
        (0, 2, 600), (1, 2, 600)]
    assert [(f.pod, f.world, f.cached, f.bytes_from_store) for f in restart_fills] == [
        ("flux-1", 1, True, 0), ("flux-0", 1, True, 0)]
    assert standin.store_bytes - before == STORE[V2]  # the whole update: one model's bytes
    assert standin.rendezvous_timeouts == []
    assert set(uids(standin, "flux-0", "flux-1").values()).isdisjoint(old.values())
    # The node rows follow the pods' loader results; a status written between two pod events
    # may still show one row from before, so wait for the next one.
    s = await eventually(lambda: (lambda st: st if [n.get("cached") for n in st["nodes"]]
                                  == [True, True] else None)(dod_status(cluster)))
    assert (s["prefill"]["state"], s["prefill"]["bytesFromStore"]) == ("Succeeded", STORE[V2])
    await eventually(lambda: [e["reason"] for e in events(cluster)][-2:] == [
        "PrefillStarted", "PrefillSucceeded"])
    print_events(cluster, "model change")
    await eventually(lambda: settings_maps(cluster) == [f"flux-settings-{s['revision']}"])
    assert live(cluster, "batch/v1/jobs", f"flux-prefill-{s['revision']}") is None


async def test_failed_prefill_keeps_old_pods_reports_and_retries(
        cluster: ClusterEmulator, standin: KubeStandIn) -> None:
    first, old, failed = await _fail_a_prefill(cluster, standin)
    kubectl_get_dod(cluster, "prefill failed")
    await eventually(lambda: any(e["reason"] == "PrefillFailed" for e in events(cluster)),
                     timeout=TIMEOUT)
    print_events(cluster, "prefill failed")
    condition = next(c for c in failed["conditions"] if c["type"] == "Prefilled")
    assert (condition["status"], condition["reason"]) == ("False", "PrefillFailed")
    assert "s3://models/flux-v2/ not readable: 403 AccessDenied" in condition["message"]
    warning = next(e for e in events(cluster) if e["reason"] == "PrefillFailed")
    assert warning["type"] == "Warning"
    assert warning["message"].startswith(f"prefill of revision {failed['revision']} (attempt 1) "
                                         "failed: loader on gpu-")
    assert warning["message"].endswith("not readable: 403 AccessDenied; the old pods keep "
                                       "serving; retrying in 1 s")
    assert uids(standin, "flux-0", "flux-1") == old
    assert template_revision(cluster) == first["revision"]
    assert [n["ready"] for n in failed["nodes"]] == [True, True]

    await eventually(lambda: (dod_status(cluster).get("prefill") or {}).get("attempt", 0) >= 2,
                     timeout=TIMEOUT)
    del standin.failing[V2]
    s = await ready(cluster, 2, revision=failed["revision"])
    kubectl_get_dod(cluster, "prefill retried")
    assert s["prefill"]["state"] == "Succeeded" and s["prefill"]["attempt"] >= 2
    assert next(c for c in s["conditions"] if c["type"] == "Prefilled")["status"] == "True"


async def test_a_prefill_pod_that_cannot_be_scheduled_is_reported_once_while_old_pods_serve(
        cluster: ClusterEmulator, standin: KubeStandIn) -> None:
    first = await create(cluster, standin)
    old = uids(standin, "flux-0", "flux-1")
    standin.unschedulable = "0/5 nodes are available: 2 Insufficient memory"

    await patch_spec(cluster, {"model": {"source": V2}})

    stuck = await eventually(lambda: (dod_status(cluster).get("prefill") or {}).get(
        "message", "").startswith("prefill of revision") and dod_status(cluster), timeout=TIMEOUT)
    kubectl_get_dod(cluster, "prefill pod unschedulable")
    await eventually(lambda: any(e["reason"] == "PrefillStuck" for e in events(cluster)))
    print_events(cluster, "prefill pod unschedulable")
    pod = next(n["pod"] for n in stuck["prefill"]["nodes"] if n["rank"] == 0)
    message = (f"prefill of revision {stuck['revision']} is stuck: pod {pod} (not scheduled): "
               "Unschedulable: 0/5 nodes are available: 2 Insufficient memory; the old pods "
               "keep serving")
    assert (stuck["phase"], stuck["stage"], stuck["message"]) == (
        "Updating", "Prefilling", message)
    assert {c["type"]: (c["status"], c["reason"], c["message"]) for c in stuck["conditions"]
            if c["type"] in ("Available", "Prefilled")} == {
        "Available": ("True", "ReplicasReady", "2/2 replicas ready"),
        "Prefilled": ("False", "PrefillStuck", message)}
    reads = len(_sts_reads(cluster))
    await eventually(lambda: len(_sts_reads(cluster)) >= reads + 2)  # reconciled twice more
    assert [(e["type"], e["message"]) for e in events(cluster)
            if e["reason"] == "PrefillStuck"] == [("Warning", message)]
    assert uids(standin, "flux-0", "flux-1") == old
    assert template_revision(cluster) == first["revision"]


async def test_reverting_the_model_after_a_failed_prefill_supersedes_it(
        cluster: ClusterEmulator, standin: KubeStandIn) -> None:
    first, old, failed = await _fail_a_prefill(cluster, standin)

    await patch_spec(cluster, {"model": {"source": V1}})

    s = await eventually(lambda: (dod_status(cluster).get("prefill") or {}).get(
        "state") == "Superseded" and dod_status(cluster), timeout=TIMEOUT)
    kubectl_get_dod(cluster, "model reverted after a failed prefill")
    prefilled = next(c for c in s["conditions"] if c["type"] == "Prefilled")
    assert (prefilled["status"], prefilled["reason"]) == ("True", "Superseded")
    assert prefilled["message"].startswith(f"prefill of revision {failed['revision']} (attempt ")
    assert prefilled["message"].endswith(
        f"superseded: the spec asks for revision {first['revision']} now")
    assert "retryAt" not in s["prefill"]
    await ready(cluster, 2, revision=first["revision"])
    assert uids(standin, "flux-0", "flux-1") == old
    # A failed attempt ended with its PrefillFailed, so only its retry is cancelled; a retry
    # already running (the backoff is 1 s here) is superseded.
    reason = ("PrefillSuperseded" if ", running) superseded" in prefilled["message"]
              else "PrefillRetryCancelled")
    await eventually(lambda: [e["reason"] for e in events(cluster)][-1] == reason)


async def test_rollback_to_a_cached_entry_reads_nothing_from_the_store(
        cluster: ClusterEmulator, standin: KubeStandIn) -> None:
    first = await create(cluster, standin)
    await patch_spec(cluster, {"model": {"source": V2}})
    await ready(cluster, 2, revision=await eventually(
        lambda: dod_status(cluster).get("revision") != first["revision"]
        and dod_status(cluster)["revision"]))
    before, fills = standin.store_bytes, len(standin.fills)

    await patch_spec(cluster, {"model": {"source": V1}})

    s = await ready(cluster, 2, revision=first["revision"])
    kubectl_get_dod(cluster, "rollback")
    assert standin.store_bytes == before
    assert all(f.cached and f.bytes_from_store == 0 for f in standin.fills[fills:])
    assert [n["cached"] for n in s["prefill"]["nodes"]] == [True, True]
    assert s["prefill"]["bytesFromStore"] == 0
    # The rollback mounts the settings of its own revision again (recreated, immutable).
    settings = json.loads(live(cluster, "v1/configmaps", f"flux-settings-{first['revision']}")[
        "data"]["settings.json"])
    assert settings["loader"]["source"] == V1


async def test_settings_change_that_keeps_the_entry_restarts_without_prefill(
        cluster: ClusterEmulator, standin: KubeStandIn) -> None:
    first = await create(cluster, standin)
    before = standin.store_bytes

    await patch_spec(cluster, {"offload": {"useAllgather": False, "residentLayers": 2}})

    s = await ready(cluster, 2, revision=await eventually(
        lambda: dod_status(cluster).get("revision") != first["revision"]
        and dod_status(cluster)["revision"]))
    # Ready at the new revision only once every pod restarted into it, not while old pods serve.
    assert revisions(standin) == [s["revision"]] * 2
    assert s.get("prefill") is None and standin.store_bytes == before
    assert not [f for f in standin.fills if f.pod.startswith("flux-prefill-")]


async def test_scale_up_and_down_restarts_no_serving_pod(
        cluster: ClusterEmulator, standin: KubeStandIn) -> None:
    await create(cluster, standin)
    serving = uids(standin, "flux-0", "flux-1")

    await patch_spec(cluster, {"replicas": 4})
    s = await ready(cluster, 4)
    kubectl_get_dod(cluster, "scaled to 4")
    assert uids(standin, "flux-0", "flux-1") == serving
    assert [(f.pod, f.rank, f.world, f.bytes_from_store) for f in standin.fills[2:]] == [
        ("flux-2", 0, 2, 500), ("flux-3", 1, 2, 500)]
    assert (s["ready"], s["cache"]) == ("4/4", "4/4")

    await patch_spec(cluster, {"replicas": 2})
    await ready(cluster, 2)
    kubectl_get_dod(cluster, "scaled to 2")
    assert uids(standin, "flux-0", "flux-1") == serving

    # A pod recreated on a node that lost its cache fills alone, waiting for no group.
    standin.caches["gpu-1"].clear()
    await request(cluster, "DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods/flux-1")
    await eventually(lambda: standin.fills[-1].pod == "flux-1" and len(standin.fills) == 5,
                     timeout=TIMEOUT)
    await ready(cluster, 2)
    assert (standin.fills[-1].world, standin.fills[-1].bytes_from_store) == (1, STORE[V1])
    assert standin.rendezvous_timeouts == []
    assert uids(standin, "flux-0") == {"flux-0": serving["flux-0"]}


async def test_a_scale_up_made_during_a_prefill_fills_its_new_pods_as_one_group(
        cluster: ClusterEmulator, standin: KubeStandIn) -> None:
    await create(cluster, standin)
    standin.hold_prefill = True
    await patch_spec(cluster, {"model": {"source": V2}})
    await eventually(lambda: dod_status(cluster).get("stage") == "Prefilling", timeout=TIMEOUT)

    await patch_spec(cluster, {"replicas": 4})
    held = await eventually(lambda: "waits for the prefill" in dod_status(cluster).get(
        "stageMessage", "") and dod_status(cluster), timeout=TIMEOUT)
    kubectl_get_dod(cluster, "scale-up during a prefill")
    standin.hold_prefill = False

    s = await ready(cluster, 4, revision=held["revision"])
    kubectl_get_dod(cluster, "prefilled, restarted and scaled")
    new_pods = [(f.pod, f.rank, f.world, f.bytes_from_store) for f in standin.fills
                if f.pod in ("flux-2", "flux-3")]
    assert sorted(new_pods) == [("flux-2", 0, 2, 600), ("flux-3", 1, 2, 600)]
    assert standin.rendezvous_timeouts == []
    assert revisions(standin) == [s["revision"]] * 4


async def test_deleted_and_hand_scaled_statefulset_are_restored(
        cluster: ClusterEmulator, standin: KubeStandIn) -> None:
    await create(cluster, standin)

    await request(cluster, "PATCH", f"{STS_PATH}/flux", {"spec": {"replicas": 5}})
    await eventually(lambda: live(cluster, "apps/v1/statefulsets", "flux")["spec"][
        "replicas"] == 2, timeout=10)
    await ready(cluster, 2)

    # Fields another controller owns are not fought over.
    await request(cluster, "PATCH", f"{STS_PATH}/flux", {"metadata": {"annotations": {
        "other.example/owner": "kept"}}})
    writes, reads = _sts_writes(cluster), len(_sts_reads(cluster))
    await eventually(lambda: len(_sts_reads(cluster)) >= reads + 2)  # it looked, twice
    assert _sts_writes(cluster) == writes
    assert live(cluster, "apps/v1/statefulsets", "flux")["metadata"]["annotations"] == {
        "other.example/owner": "kept"}

    await request(cluster, "DELETE", f"{STS_PATH}/flux")
    await eventually(lambda: live(cluster, "apps/v1/statefulsets", "flux") is not None,
                     timeout=10)
    await ready(cluster, 2)
    kubectl_get_dod(cluster, "statefulset restored")
    assert standin.rendezvous_timeouts == []


def _sts_writes(cluster: ClusterEmulator) -> int:
    return len([r for r in list(cluster) if r.resource is not None and r.method == "PATCH"
                and r.resource.plural == "statefulsets" and "apply" in r.headers.get(
                    "Content-Type", "")])


def _sts_reads(cluster: ClusterEmulator) -> list[Any]:
    return [r for r in list(cluster) if r.resource is not None and r.method == "GET"
            and r.resource.plural == "statefulsets"]


async def _fail_a_prefill(cluster: ClusterEmulator, standin: KubeStandIn
                          ) -> tuple[dict[str, Any], Any, dict[str, Any]]:
    """A serving DOD whose model change to V2 fails its prefill (the store refuses V2): the
    first status, the serving pods' uids, and the status once the prefill failed."""
    first = await create(cluster, standin)
    old = uids(standin, "flux-0", "flux-1")
    standin.failing[V2] = "s3://models/flux-v2/ not readable: 403 AccessDenied"
    await patch_spec(cluster, {"model": {"source": V2}})
    failed = await eventually(lambda: (dod_status(cluster).get("prefill") or {}).get(
        "state") == "Failed" and dod_status(cluster), timeout=TIMEOUT)
    return first, old, failed
