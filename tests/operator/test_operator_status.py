"""`status_from_pods`: phases, conditions and per-node rows from pod and loader states."""

from __future__ import annotations

import json
from typing import Any

from dlo_operator.conditions import Condition
from dlo_operator.status import node_entry, prefill_node, status_from_pods

NOW = "2030-01-01T00:00:00Z"
LATER = "2030-01-01T00:05:00Z"
SUMMARY = {"status": "ok", "entry_id": "ab" * 32, "mode": "multi-reader", "rank": 1,
           "world_size": 2, "bytes_from_store": 10, "bytes_from_peers": 30, "bytes_to_peers": 10,
           "seconds": 1.5, "cached": False}


def pod(index: int, loader: dict[str, Any] | None = None, *, ready: bool = False,
        inference: dict[str, Any] | None = None, revision: str = "") -> dict[str, Any]:
    status: dict[str, Any] = {"conditions": [{"type": "Ready", "status": str(ready)}]}
    if loader is not None:
        status["initContainerStatuses"] = [{"name": "loader", "restartCount": 0, **loader}]
    if inference is not None:
        status["containerStatuses"] = [{"name": "inference", **inference}]
    return {"metadata": {"name": f"flux-{index}", "labels": {
        "apps.kubernetes.io/pod-index": str(index)},
        "annotations": {"dlo.dev/revision": revision} if revision else {}},
        "spec": {"nodeName": f"node-{index}"}, "status": status}


def done(summary: dict[str, Any] = SUMMARY) -> dict[str, Any]:
    return {"state": {"terminated": {"exitCode": 0, "message": json.dumps(summary)}}}


def conditions(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_no_pods_is_pending() -> None:
    status = status_from_pods([], replicas=2, previous=None, now=NOW)
    assert (status["phase"], status["message"]) == (
        "Pending", "0/2 pods created, no loader started yet")
    assert conditions(status) == {"Valid": ("True", "SpecValid"),
                                  "Applied": ("True", "ChildrenApplied"),
                                  "CacheReady": ("False", "Loading"),
                                  "Available": ("False", "ReplicasNotReady"),
                                  "Progressing": ("True", "Pending"),
                                  "Ready": ("False", "Pending")}


def test_a_running_loader_is_loading() -> None:
    status = status_from_pods([pod(0, {"state": {"running": {}}}), pod(1)], replicas=2,
                              previous=None, now=NOW)
    assert (status["phase"], status["cache"], status["ready"]) == ("Loading", "0/2", "0/2")
    assert [n["loader"] for n in status["nodes"]] == ["Running", "Waiting"]


def test_finished_loaders_report_their_summary_and_ready_pods_make_it_ready() -> None:
    status = status_from_pods([pod(1, done(), ready=True), pod(0, done(), ready=True)],
                              replicas=2, previous=None, now=NOW)
    assert status["phase"] == "Ready"
    assert conditions(status)["CacheReady"] == ("True", "AllNodesCached")
    assert conditions(status)["Progressing"] == ("False", "Complete")
    assert status["nodes"][1] == {
        "pod": "flux-1", "node": "node-1", "rank": 1, "loader": "Cached", "restarts": 0,
        "ready": True, "entryId": "ab" * 32, "mode": "multi-reader", "bytesFromStore": 10,
        "bytesFromPeers": 30, "seconds": 1.5, "cached": False}


def test_pods_of_an_older_revision_serve_but_the_spec_s_revision_is_not_ready() -> None:
    """Right after a spec change only old pods exist: they serve (`Available`), but `Ready`
    waits for every pod at the spec's revision, so `kubectl wait` does not return early."""
    old = [pod(0, done(), ready=True, revision="r1"), pod(1, done(), ready=True, revision="r2")]
    status = status_from_pods(old, replicas=2, previous=None, now=NOW, generation=7,
                              revision="r2")
    assert (status["phase"], status["message"]) == (
        "Updating", "rolling update to revision r2: 1/2 pods updated, 2/2 replicas ready")
    assert (status["readyReplicas"], status["updatedReplicas"]) == (2, 1)
    assert {kind: conditions(status)[kind] for kind in ("Available", "Progressing", "Ready")} == {
        "Available": ("True", "ReplicasReady"), "Progressing": ("True", "RollingUpdate"),
        "Ready": ("False", "RollingUpdate")}
    rolled = [pod(i, done(), ready=True, revision="r2") for i in range(2)]
    status = status_from_pods(rolled, replicas=2, previous=status, now=LATER, revision="r2")
    assert (status["phase"], conditions(status)["Progressing"], status["updatedReplicas"]) == (
        "Ready", ("False", "Complete"), 2)


def test_a_sidecar_loader_is_cached_once_ready_with_the_summary_kept_on_its_pod() -> None:
    """The workload loader is a native sidecar: it stays running after it published, and its
    readiness says so; the operator keeps the summary its endpoint served on the pod."""
    filling = {"ready": False, "state": {"running": {}}}
    published = {"ready": True, "state": {"running": {}}}
    kept = pod(1, published, ready=True)
    kept["metadata"]["annotations"] = {"dlo.dev/fill-summary": json.dumps(SUMMARY)}
    status = status_from_pods([pod(0, filling), pod(2, published), kept], replicas=3,
                              previous=None, now=NOW)
    rows = {n["pod"]: n for n in status["nodes"]}
    assert [rows[f"flux-{i}"]["loader"] for i in range(3)] == ["Running", "Cached", "Cached"]
    assert rows["flux-1"]["bytesFromPeers"] == 30 and "bytesFromPeers" not in rows["flux-2"]
    assert (status["phase"], status["cache"]) == ("Loading", "2/3")


def test_a_running_prefill_loader_is_not_cached_before_it_ends() -> None:
    """A prefill Job's container has no readiness probe (ready as soon as it runs): only its
    successful end says the node holds the entry."""
    job_pod = {"metadata": {"name": "flux-prefill-0", "labels": {
        "batch.kubernetes.io/job-completion-index": "0"}}, "spec": {"nodeName": "n"},
        "status": {"containerStatuses": [{"name": "loader", "ready": True,
                                          "state": {"running": {}}}]}}
    assert prefill_node(job_pod)["loader"] == "Running"


def test_a_crash_looping_loader_is_degraded_with_its_error() -> None:
    failing = {"restartCount": 5, "state": {"waiting": {"reason": "CrashLoopBackOff"}},
               "lastState": {"terminated": {"exitCode": 1, "message": json.dumps(
                   {"status": "error", "rank": 0, "error": "no space left on /var/lib/dlo"})}}}
    status = status_from_pods([pod(0, failing), pod(1, done())], replicas=2, previous=None, now=NOW)
    assert status["phase"] == "Degraded"
    assert status["message"] == ("loader container of pod flux-0 on node node-0: LoaderFailed: "
                                 "CrashLoopBackOff: no space left on /var/lib/dlo")
    assert conditions(status)["CacheReady"] == ("False", "LoaderFailed")
    assert conditions(status)["Progressing"] == ("False", "LoaderFailed")
    assert conditions(status)["Ready"] == ("False", "LoaderFailed")


def test_a_loader_that_died_without_a_summary_shows_its_log_tail() -> None:
    crashed = {"state": {"terminated": {"exitCode": 137, "reason": "OOMKilled",
                                        "message": "reading chunk 3\nKilled\n"}}}
    entry = node_entry(pod(0, crashed))
    assert (entry["loader"], entry["message"]) == ("Failed", "Killed")
    silent = {"state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}
    assert node_entry(pod(0, silent))["message"] == "exit code 137 (OOMKilled)"


def test_missing_credentials_secret_is_a_failure_not_a_wait() -> None:
    waiting = {"state": {"waiting": {"reason": "CreateContainerConfigError",
                                     "message": 'secret "keys" not found'}}}
    status = status_from_pods([pod(0, waiting)], replicas=1, previous=None, now=NOW)
    assert status["message"] == (
        'loader container of pod flux-0 on node node-0: CreateContainerConfigError: '
        'secret "keys" not found')


def test_a_crash_looping_inference_container_is_degraded() -> None:
    status = status_from_pods([pod(0, done(), inference={"state": {"waiting": {
        "reason": "CrashLoopBackOff", "message": "back-off 5m0s"}}})], replicas=1,
        previous=None, now=NOW)
    assert (status["phase"], status["message"]) == (
        "Degraded",
        "inference container of pod flux-0 on node node-0: CrashLoopBackOff: back-off 5m0s")
    assert conditions(status)["CacheReady"] == ("True", "AllNodesCached")
    assert conditions(status)["Ready"] == ("False", "CrashLoopBackOff")


def test_an_unschedulable_pod_is_pending_not_loading_and_names_the_pod() -> None:
    stuck = pod(1)
    stuck["spec"] = {}
    stuck["status"]["conditions"] = [{
        "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
        "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."}]
    status = status_from_pods([pod(0, {"state": {"running": {}}}), stuck], replicas=2,
                              previous=None, now=NOW)
    assert (status["phase"], status["message"]) == (
        "Pending", "pod flux-1 (not scheduled): Unschedulable: 0/4 nodes are available: "
        "4 Insufficient nvidia.com/gpu.")
    assert conditions(status)["Ready"] == ("False", "Unschedulable")


def test_image_pull_and_oom_kills_are_named_as_such() -> None:
    pulling = {"state": {"waiting": {"reason": "ImagePullBackOff",
                                     "message": 'Back-off pulling image "server:9"'}}}
    status = status_from_pods([pod(0, done(), inference=pulling)], replicas=1, previous=None,
                              now=NOW)
    assert (status["phase"], status["message"]) == (
        "Degraded", "inference container of pod flux-0 on node node-0: ImagePullBackOff: "
        'Back-off pulling image "server:9"')
    oom = {"restartCount": 2, "state": {"waiting": {"reason": "CrashLoopBackOff"}},
           "lastState": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}
    status = status_from_pods([pod(0, oom)], replicas=1, previous=None, now=NOW)
    assert (status["phase"], status["message"]) == (
        "Degraded", "loader container of pod flux-0 on node node-0: OOMKilled: killed for "
        "exceeding the container's memory limit; raise it")
    assert conditions(status)["CacheReady"] == ("False", "OOMKilled")


def test_invalid_spec_is_failed_whatever_the_pods_say() -> None:
    refused = Condition("Valid", "False", "SpecInvalid", "invalid settings: x")
    status = status_from_pods([pod(0, done(), ready=True)], replicas=1, previous=None, now=NOW,
                              generation=3, problems=[refused])
    assert (status["phase"], status["message"]) == ("Failed", "invalid settings: x")
    assert conditions(status)["Valid"] == ("False", "SpecInvalid")
    assert conditions(status)["Ready"] == ("False", "SpecInvalid")
    assert {c["observedGeneration"] for c in status["conditions"]} == {3}


def test_an_api_error_being_retried_is_pending_and_a_refusal_is_failed() -> None:
    retrying = Condition("Applied", "False", "ApplyRetrying", "answered 503; attempt 2 in 1 s")
    status = status_from_pods([], replicas=1, previous=None, now=NOW, problems=[retrying])
    assert (status["phase"], conditions(status)["Applied"]) == (
        "Pending", ("False", "ApplyRetrying"))
    refused = Condition("Applied", "False", "ApplyFailed", "answered 422")
    status = status_from_pods([], replicas=1, previous=status, now=NOW, problems=[refused])
    assert (status["phase"], conditions(status)["Ready"]) == ("Failed", ("False", "ApplyFailed"))


def test_conditions_of_other_owners_are_kept() -> None:
    previous = {"conditions": [{"type": "Prefilled", "status": "True", "reason": "Done",
                                "message": "", "lastTransitionTime": NOW}]}
    status = status_from_pods([], replicas=1, previous=previous, now=LATER)
    assert status["conditions"][-1] == previous["conditions"][0]


def test_terminating_pods_are_not_counted() -> None:
    leaving = pod(0, done(), ready=True)
    leaving["metadata"]["deletionTimestamp"] = NOW
    status = status_from_pods([leaving], replicas=1, previous=None, now=NOW)
    assert (status["phase"], status["nodes"]) == ("Pending", [])


def test_transition_times_change_only_with_the_condition_status() -> None:
    first = status_from_pods([pod(0, {"state": {"running": {}}})], replicas=1,
                             previous=None, now=NOW)
    second = status_from_pods([pod(0, done(), ready=True)], replicas=1, previous=first, now=LATER)
    times = {c["type"]: c["lastTransitionTime"] for c in second["conditions"]}
    assert times == {"Valid": NOW, "Applied": NOW, "CacheReady": LATER, "Available": LATER,
                     "Progressing": LATER, "Ready": LATER}
