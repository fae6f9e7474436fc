"""The rollout decision: a finished prefill's record is final once the pods restart, so the
operator waits for the loaders' summaries that arrive after the Job's success; a scale-up fills
its new pods as one group, one group at a time, and a group cut short by a scale-down is over."""

from __future__ import annotations

import datetime
from typing import Any

import pytest
from support.rollout_specs import NEW, NODES, NOW, OLD, OWNER

from dlo_contract.documents import FillStatus, FillSummary
from dlo_contract.fill_group import FILL_GROUP_KEY, FillGroup
from dlo_operator.configmap import entry_key, revision
from dlo_operator.decision import Observed, Stage
from dlo_operator.manifests import build_children, fill_group
from dlo_operator.naming import LABEL_JOB_INDEX, LABEL_REVISION, LOADER_CONTAINER
from dlo_operator.prefill import build_prefill_job, pinned_nodes
from dlo_operator.prefill_stage import SUMMARY_GRACE_S, BackoffConfig
from dlo_operator.rollout import decide
from dlo_operator.spec import DeploymentSpec, parse_spec
from dlo_operator.statefulset import build_statefulset


def serving_pod(index: int) -> dict[str, Any]:
    return {"metadata": {"name": f"flux-{index}", "labels": {}}, "spec": {"nodeName": NODES[index]}}


def job_pod(index: int, bytes_from_store: int) -> dict[str, Any]:
    summary = FillSummary(status=FillStatus.OK, rank=index, world_size=2, entry_id="e",
                          mode="multi-reader", bytes_from_store=bytes_from_store,
                          bytes_from_peers=0, bytes_to_peers=0, seconds=1.0, cached=False)
    return {"metadata": {"name": f"flux-prefill-{index}",
                         "labels": {LABEL_REVISION: revision(NEW), LABEL_JOB_INDEX: str(index)}},
            "spec": {"nodeName": NODES[index]},
            "status": {"containerStatuses": [{"name": LOADER_CONTAINER, "state": {"terminated": {
                "exitCode": 0, "message": summary.to_json()}}}]}}


def seen(job_pods: list[dict[str, Any]], completed_s_ago: float | None) -> Observed:
    status: dict[str, Any] = {"conditions": [{"type": "Complete", "status": "True"}]}
    if completed_s_ago is not None:
        done = NOW - datetime.timedelta(seconds=completed_s_ago)
        status["completionTime"] = done.strftime("%Y-%m-%dT%H:%M:%SZ")
    job = {"metadata": {"name": OWNER.prefill_name(revision(NEW))},
           "spec": {"completions": 2}, "status": status}
    return Observed(statefulset=build_children(OWNER, OLD)[3], pods=[serving_pod(0),
                    serving_pod(1)], group=None, jobs=[job], job_pods=job_pods,
                    settings_configmaps=[], prefill={"revision": revision(NEW), "attempt": 1},
                    now=NOW)


def test_a_completed_prefill_waits_for_its_loaders_summaries() -> None:
    decision = decide(OWNER, NEW, seen([job_pod(0, 600)], completed_s_ago=1), BackoffConfig())
    assert decision.stage is Stage.PREFILLING
    assert decision.message.endswith("succeeded; waiting for the loaders' summaries (1/2)")
    assert not decision.reports and ("Job", OWNER.prefill_name(revision(NEW))) not in (
        decision.delete)


def test_a_completed_prefill_with_every_summary_restarts_with_the_bytes_read() -> None:
    decision = decide(OWNER, NEW, seen([job_pod(0, 600), job_pod(1, 600)], completed_s_ago=1),
                      BackoffConfig())
    assert decision.stage is Stage.RESTARTING
    assert (decision.prefill["state"], decision.prefill["bytesFromStore"]) == ("Succeeded", 1200)
    assert [r.reason for r in decision.reports] == ["PrefillSucceeded"]


def test_summaries_that_never_come_are_not_waited_for_past_the_grace_period() -> None:
    decision = decide(OWNER, NEW, seen([job_pod(0, 600)], completed_s_ago=SUMMARY_GRACE_S + 1),
                      BackoffConfig())
    assert decision.stage is Stage.RESTARTING
    assert decision.prefill["message"] == "1/1 nodes hold the entry, 600 bytes read from the store"


def test_a_failed_prefill_keeps_its_reason_on_show_through_the_backoff() -> None:
    """The failed Job is deleted at once; every reconcile of the backoff that follows still says
    why the prefill failed, not only that it did."""
    why = "loader on gpu-0: s3://models/flux-v2/ not readable: 403 AccessDenied"
    failed = {"revision": revision(NEW), "attempt": 1, "state": "Failed", "message": why,
              "retryAt": (NOW + datetime.timedelta(seconds=10)).strftime("%Y-%m-%dT%H:%M:%SZ")}
    later = seen([], completed_s_ago=None)
    later = Observed(**{**vars(later), "jobs": [], "prefill": failed})
    decision = decide(OWNER, NEW, later, BackoffConfig())
    assert decision.stage is Stage.BACKOFF
    assert decision.message.startswith(
        f"prefill of revision {revision(NEW)} failed (attempt 1): {why}; old pods keep serving")


def scaled(replicas: int) -> DeploymentSpec:
    return parse_spec({"model": {"source": "s3://models/flux-v1/"},
                       "inference": {"image": "s:1"}, "replicas": replicas})


def cached_pod(index: int) -> dict[str, Any]:
    return {"metadata": {"name": f"flux-{index}", "labels": {}},
            "spec": {"nodeName": f"gpu-{index}"},
            "status": {"initContainerStatuses": [{"name": LOADER_CONTAINER, "ready": True,
                                                  "state": {"running": {}}}]}}


def serving(spec: DeploymentSpec, live: int, pods: list[dict[str, Any]],
            group: FillGroup) -> Observed:
    return Observed(statefulset=build_statefulset(OWNER, spec, live), pods=pods, group=group,
                    jobs=[], job_pods=[], settings_configmaps=[], prefill={}, now=NOW)


def applied(decision: Any, kind: str, name: str = "flux") -> dict[str, Any]:
    return next(m for m in decision.apply if (m["kind"], m["metadata"]["name"]) == (kind, name))


def published_group(decision: Any) -> FillGroup:
    return FillGroup.from_json(applied(decision, "ConfigMap", OWNER.fill_group_name)["data"][
        FILL_GROUP_KEY])


def test_a_scale_up_cancelled_before_its_pods_filled_closes_its_group() -> None:
    """2 -> 4 opened the group {flux-2, flux-3}; back to 2 before they filled, the group can
    never meet: it is closed, and the next scale-up is not held back by it."""
    opened = fill_group(OWNER, scaled(4), range(2, 4))
    pods = [cached_pod(0), cached_pod(1)]
    back = decide(OWNER, scaled(2), serving(scaled(2), 4, pods, opened), BackoffConfig())
    assert (back.stage, back.message) == (Stage.SERVING, "scaling 4 -> 2: removing pods, no "
                                                         "other pod restarts")
    assert published_group(back) == FillGroup()
    again = decide(OWNER, scaled(3), serving(scaled(2), 2, pods, opened), BackoffConfig())
    assert applied(again, "StatefulSet")["spec"]["replicas"] == 3


def test_a_scale_up_waits_for_the_open_group_and_says_so() -> None:
    opened = fill_group(OWNER, scaled(4), range(2, 4))
    filling = {"metadata": {"name": "flux-2", "labels": {}}, "spec": {"nodeName": "gpu-2"}}
    pods = [cached_pod(0), cached_pod(1), filling]
    decision = decide(OWNER, scaled(6), serving(scaled(4), 4, pods, opened), BackoffConfig())
    assert applied(decision, "StatefulSet")["spec"]["replicas"] == 4
    assert decision.message == (
        f"serving revision {revision(scaled(6))}; scaling 4 -> 6 waits for the fill group of "
        "flux-2, flux-3 to finish (one group at a time)")


def test_a_scale_up_during_a_prefill_says_it_waits_for_the_prefill() -> None:
    bigger = parse_spec({"model": {"source": "s3://models/flux-v2/"},
                         "inference": {"image": "s:1"}, "replicas": 4})
    started = Observed(**{**vars(seen([], completed_s_ago=None)), "jobs": [], "prefill": {}})
    decision = decide(OWNER, bigger, started, BackoffConfig())
    assert decision.stage is Stage.PREFILLING
    assert decision.message == (f"prefilling revision {revision(bigger)} on 2 nodes while the "
                                "old pods serve; scaling 2 -> 4 waits for the prefill")


def test_optional_children_the_spec_turns_off_are_deleted() -> None:
    """`disruptionBudget.enabled: false` and no `inference.ports`: the PodDisruptionBudget and
    the inference Service this DOD made go; while the spec asks for them they stay."""
    made = (("Service", OWNER.inference_service_name),
            ("PodDisruptionBudget", OWNER.disruption_budget_name))
    pods = [cached_pod(0), cached_pod(1)]
    off = Observed(**{**vars(serving(scaled(2), 2, pods, FillGroup())), "optional": made})
    assert [d for d in decide(OWNER, scaled(2), off, BackoffConfig()).delete
            if d in made] == list(made)
    on = parse_spec({"model": {"source": "s3://models/flux-v1/"}, "replicas": 2,
                     "inference": {"image": "s:1", "ports": [{"containerPort": 8000}]},
                     "disruptionBudget": {"enabled": True}})
    assert not [d for d in decide(OWNER, on, off, BackoffConfig()).delete if d in made]


@pytest.mark.parametrize(("state", "reason"), [("Failed", "PrefillRetryCancelled"),
                                               ("Running", "PrefillSuperseded")])
def test_a_prefill_the_spec_no_longer_asks_for_is_superseded(state: str, reason: str) -> None:
    """The model reverted during a prefill or its backoff: the old revision serves on, and the
    record of the abandoned prefill ends, once, without a retry time. A running attempt ends
    here (`PrefillSuperseded`); a failed one ended with its `PrefillFailed`, so only its retry
    is cancelled."""
    abandoned = {"revision": revision(NEW), "attempt": 2, "state": state, "nodes": [],
                 "message": "loader on gpu-0: 403 AccessDenied", "retryAt": "2026-12-01T09:05:00Z"}
    reverted = Observed(**{**vars(serving(OLD, 2, [cached_pod(0), cached_pod(1)], FillGroup())),
                           "prefill": abandoned})
    decision = decide(OWNER, OLD, reverted, BackoffConfig())
    message = (f"prefill of revision {revision(NEW)} (attempt 2, {state.lower()}) superseded: "
               f"the spec asks for revision {revision(OLD)} now")
    assert decision.stage is Stage.SERVING
    assert decision.prefill == {"revision": revision(NEW), "attempt": 2, "nodes": [],
                                "state": "Superseded", "message": message}
    assert [(r.type.value, r.reason, r.message) for r in decision.reports] == [
        ("Normal", reason, message)]
    later = Observed(**{**vars(reverted), "prefill": decision.prefill})
    again = decide(OWNER, OLD, later, BackoffConfig())
    assert (again.prefill, again.reports) == (decision.prefill, [])


def running_prefill(serving_on: tuple[str, ...], stuck_pod: dict[str, Any]) -> Observed:
    """A prefill Job pinned to gpu-0 and gpu-1, its pod 0 filling, `stuck_pod` its pod 1."""
    job = {**build_prefill_job(OWNER, NEW, NODES), "status": {"active": 2}}
    filling = {"metadata": {"name": "flux-prefill-0", "labels": {
        LABEL_REVISION: revision(NEW), LABEL_JOB_INDEX: "0"}}, "spec": {"nodeName": "gpu-0"},
        "status": {"containerStatuses": [{"name": LOADER_CONTAINER, "state": {"running": {}}}]}}
    pods = [{"metadata": {"name": f"flux-{i}", "labels": {}}, "spec": {"nodeName": node}}
            for i, node in enumerate(serving_on)]
    return Observed(statefulset=build_children(OWNER, OLD)[3], pods=pods, group=None,
                    jobs=[job], job_pods=[filling, stuck_pod], settings_configmaps=[],
                    prefill={"revision": revision(NEW), "attempt": 1, "state": "Running"},
                    now=NOW)


def stuck_prefill_pod(node: str, status: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": "flux-prefill-1", "labels": {
        LABEL_REVISION: revision(NEW), LABEL_JOB_INDEX: "1"}},
        "spec": {"nodeName": node} if node else {}, "status": status}


UNSCHEDULABLE = {"phase": "Pending", "conditions": [{
    "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
    "message": "0/3 nodes are available: 1 Insufficient memory, 2 node(s) didn't match Pod's "
               "node affinity/selector"}]}
IMAGE_PULL = {"phase": "Pending", "containerStatuses": [{"name": LOADER_CONTAINER, "state": {
    "waiting": {"reason": "ImagePullBackOff",
                "message": 'Back-off pulling image "registry.example/dlo-loader:typo"'}}}]}


@pytest.mark.parametrize(("node", "status", "trouble"), [
    ("", UNSCHEDULABLE, "pod flux-prefill-1 (not scheduled): Unschedulable: 0/3 nodes are "
                        "available: 1 Insufficient memory, 2 node(s) didn't match Pod's node "
                        "affinity/selector"),
    ("gpu-1", IMAGE_PULL, "loader container of pod flux-prefill-1 on node gpu-1: "
                          'ImagePullBackOff: Back-off pulling image '
                          '"registry.example/dlo-loader:typo"'),
], ids=["unschedulable", "image-pull"])
def test_a_prefill_pod_that_cannot_start_is_named_while_the_old_pods_serve(
        node: str, status: dict[str, Any], trouble: str) -> None:
    """The Job alone would wait for it until its deadline, an hour on: the stage says which pod
    and why (the scheduler's or the kubelet's words), and the StatefulSet is not touched."""
    decision = decide(OWNER, NEW, running_prefill(NODES, stuck_prefill_pod(node, status)),
                      BackoffConfig())
    message = f"prefill of revision {revision(NEW)} is stuck: {trouble}; the old pods keep serving"
    assert (decision.stage, decision.message) == (Stage.PREFILLING, message)
    assert decision.stuck is not None and decision.stuck.message == trouble
    assert (decision.prefill["state"], decision.prefill["message"]) == ("Running", message)
    assert not decision.reports and not [d for d in decision.delete if d[0] == "Job"]
    assert "StatefulSet" not in [m["kind"] for m in decision.apply]


def test_a_prefill_pod_pinned_to_a_node_that_left_fails_the_attempt_at_once() -> None:
    """gpu-1 was replaced during the prefill (its pod now serves on gpu-2): the Job's pod pinned
    there can never be scheduled, so the attempt ends now and the retry fills the serving nodes."""
    seen_now = running_prefill(("gpu-0", "gpu-2"), stuck_prefill_pod("", UNSCHEDULABLE))
    decision = decide(OWNER, NEW, seen_now, BackoffConfig())
    why = ("pod flux-prefill-1 (not scheduled): Unschedulable: 0/3 nodes are available: 1 "
           "Insufficient memory, 2 node(s) didn't match Pod's node affinity/selector; the Job is "
           "pinned to gpu-1, where no pod of this DOD runs any more, so the next attempt fills "
           "the nodes that serve now")
    assert (decision.stage, decision.prefill["state"]) == (Stage.BACKOFF, "Failed")
    assert (decision.prefill["message"], decision.prefill["retryAt"]) == (
        why, "2026-12-01T09:00:10Z")
    assert ("Job", OWNER.prefill_name(revision(NEW))) in decision.delete
    assert [(r.type.value, r.reason) for r in decision.reports] == [("Warning", "PrefillFailed")]
    retry = Observed(**{**vars(seen_now), "jobs": [], "job_pods": [],
                        "prefill": {**decision.prefill, "retryAt": "2026-12-01T08:59:00Z"}})
    job = applied(decide(OWNER, NEW, retry, BackoffConfig()), "Job",
                  OWNER.prefill_name(revision(NEW)))
    assert pinned_nodes(job) == ["gpu-0", "gpu-2"]


@pytest.mark.parametrize("restart", ["after a prefill", "entry unchanged"])
def test_a_scale_up_held_through_a_restart_fills_its_new_pods_as_one_group(restart: str) -> None:
    """2 -> 4 asked for during a prefill, or with a settings change that keeps the entry: the
    restart rolls the 2 live pods and says the scale waits; the step after it scales to 4 with
    flux-2 and flux-3 in one fill group, instead of each reading the whole model alone."""
    if restart == "after a prefill":
        bigger = parse_spec({"model": {"source": "s3://models/flux-v2/"},
                             "inference": {"image": "s:1"}, "replicas": 4})
        before = seen([job_pod(0, 600), job_pod(1, 600)], completed_s_ago=1)
    else:
        bigger = parse_spec({"model": {"source": "s3://models/flux-v1/"}, "replicas": 4,
                             "inference": {"image": "s:1"},
                             "offload": {"useAllgather": False, "residentLayers": 2}})
        before = serving(OLD, 2, [cached_pod(0), cached_pod(1)], FillGroup())
    restarting = decide(OWNER, bigger, before, BackoffConfig())
    assert restarting.stage is Stage.RESTARTING
    assert applied(restarting, "StatefulSet")["spec"]["replicas"] == 2
    assert published_group(restarting) == FillGroup()
    assert restarting.message.endswith(
        "; scaling 2 -> 4 waits for the restart to be applied (its new pods then fill as one "
        "group)")
    restarted = serving(bigger, 2, [cached_pod(0), cached_pod(1)], FillGroup())
    scaling = decide(OWNER, bigger, restarted, BackoffConfig())
    assert applied(scaling, "StatefulSet")["spec"]["replicas"] == 4
    assert published_group(scaling).members == {"flux-2": 0, "flux-3": 1}


EDITED = parse_spec({"model": {"source": "s3://models/flux-v2/"}, "inference": {"image": "s:1"},
                     "replicas": 2, "offload": {"useAllgather": False, "residentLayers": 2}})
"""NEW with a settings edit that keeps its cache entry: another revision, the same entry."""
THIRD = parse_spec({"model": {"source": "s3://models/flux-v3/"}, "inference": {"image": "s:1"},
                    "replicas": 2})


def failed_record(spec: DeploymentSpec) -> dict[str, Any]:
    return {"revision": revision(spec), "entryKey": entry_key(spec), "attempt": 1,
            "state": "Failed", "nodes": [], "message": "loader on gpu-0: 403 AccessDenied",
            "retryAt": "2026-12-01T09:05:00Z"}


def test_a_settings_edit_that_keeps_the_entry_continues_the_backoff_of_its_prefill() -> None:
    """The edit's revision waits out the failed attempt's backoff, counts on from its attempt
    and keeps its reason on show; no prefill starts and nothing is superseded."""
    in_backoff = Observed(**{**vars(seen([], completed_s_ago=None)), "jobs": [],
                             "prefill": failed_record(NEW)})
    decision = decide(OWNER, EDITED, in_backoff, BackoffConfig())
    assert (decision.stage, decision.reports) == (Stage.BACKOFF, [])
    assert decision.message.startswith(f"prefill of revision {revision(EDITED)} failed "
                                       "(attempt 1): loader on gpu-0: 403 AccessDenied")
    assert {key: decision.prefill[key] for key in ("revision", "attempt", "state", "retryAt")} == {
        "revision": revision(EDITED), "attempt": 1, "state": "Failed",
        "retryAt": "2026-12-01T09:05:00Z"}
    due = Observed(**{**vars(in_backoff), "prefill": decision.prefill,
                      "now": NOW + datetime.timedelta(minutes=6)})
    retry = decide(OWNER, EDITED, due, BackoffConfig())
    assert (retry.stage, retry.prefill["attempt"]) == (Stage.PREFILLING, 2)
    assert [r.reason for r in retry.reports] == ["PrefillStarted"]


def test_another_entry_asked_for_during_a_backoff_cancels_the_retry_and_starts_at_once() -> None:
    in_backoff = Observed(**{**vars(seen([], completed_s_ago=None)), "jobs": [],
                             "prefill": failed_record(NEW)})
    decision = decide(OWNER, THIRD, in_backoff, BackoffConfig())
    assert decision.stage is Stage.PREFILLING and decision.prefill["attempt"] == 1
    assert [r.reason for r in decision.reports] == ["PrefillRetryCancelled", "PrefillStarted"]


@pytest.mark.parametrize("spec", [EDITED, THIRD], ids=["same-entry", "other-entry"])
def test_a_change_during_a_prefill_supersedes_it_before_the_next_starts(
        spec: DeploymentSpec) -> None:
    """B -> C while B's prefill runs: B's Job is deleted and B ends, once, superseded."""
    running = Observed(**{**vars(running_prefill(NODES, stuck_prefill_pod("gpu-1", {}))),
                          "prefill": {**failed_record(NEW), "state": "Running"}})
    decision = decide(OWNER, spec, running, BackoffConfig())
    assert [(r.reason, r.message) for r in decision.reports] == [
        ("PrefillSuperseded", f"prefill of revision {revision(NEW)} (attempt 1, running) "
                              f"superseded: the spec asks for revision {revision(spec)} now"),
        ("PrefillStarted", decision.reports[1].message)]
    assert ("Job", OWNER.prefill_name(revision(NEW))) in decision.delete
    assert (decision.prefill["revision"], decision.prefill["attempt"]) == (revision(spec), 1)


def test_a_job_out_of_time_names_the_nodes_whose_loader_had_not_finished() -> None:
    """The Job controller removed the pods at its deadline: the record's last rows name them."""
    job = {**build_prefill_job(OWNER, NEW, NODES), "status": {"conditions": [{
        "type": "Failed", "status": "True", "reason": "DeadlineExceeded",
        "message": "Job was active longer than specified deadline"}]}}
    rows = [{"pod": "flux-prefill-0", "node": "gpu-0", "rank": 0, "loader": "Cached"},
            {"pod": "flux-prefill-1", "node": "gpu-1", "rank": 1, "loader": "Running"}]
    out_of_time = Observed(**{**vars(running_prefill(NODES, stuck_prefill_pod("gpu-1", {}))),
                              "jobs": [job], "job_pods": [],
                              "prefill": {"revision": revision(NEW), "attempt": 1,
                                          "state": "Running", "nodes": rows}})
    decision = decide(OWNER, NEW, out_of_time, BackoffConfig())
    assert decision.prefill["message"] == (
        "Job DeadlineExceeded: Job was active longer than specified deadline; not finished on "
        "gpu-1 (pod flux-prefill-1, loader Running)")
