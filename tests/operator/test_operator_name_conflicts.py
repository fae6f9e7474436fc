"""Child names of two DODs can meet (issue 35): DOD `flux`'s headless Service `flux-peers` is DOD
`flux-peers`'s inference Service. The operator writes no object another DOD controls: the second
DOD gets no children and `Applied=False` (reason `NameConflict`) naming the owner, whichever of
the two came first, and the first one's child is never written for it. Nor one that nothing
controls (issue 43): a DOD named like another team's Service does not take it over."""

from __future__ import annotations

from typing import Any

import pytest
from support.operator_harness import (
    DOD_PATH,
    DOD_RESOURCE,
    NAMESPACE,
    ClusterEmulator,
    Operator,
    dod_status,
    eventually,
    live,
    request,
)

from dlo_operator.naming import KIND, UNCONTROLLED, Owner, child_metadata, foreign_controller

SERVICES = "v1/services"


def dod(name: str, ports: bool) -> dict[str, Any]:
    inference: dict[str, Any] = {"image": "server:1"}
    if ports:
        inference["ports"] = [{"name": "http", "containerPort": 8000}]
    return {"apiVersion": "dlo.dev/v1alpha1", "kind": KIND,
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"replicas": 2, "model": {"source": "s3://models/flux/"},
                     "inference": inference}}


def writes_to(cluster: ClusterEmulator, plural: str, name: str) -> int:
    """Requests that create, change or delete the object `name` of `plural`."""
    return sum(1 for r in list(cluster) if r.resource is not None and r.resource.plural == plural
               and r.name == name and r.method in ("POST", "PATCH", "PUT", "DELETE"))


def applied(cluster: ClusterEmulator, name: str) -> dict[str, Any] | None:
    return next((c for c in dod_status(cluster, name).get("conditions", ())
                 if c["type"] == "Applied"), None)


@pytest.mark.parametrize("first_has_ports", [False, True],
                         ids=["headless-service-first", "inference-service-first"])
async def test_the_second_dod_whose_child_name_is_taken_writes_nothing_and_names_the_owner(
        cluster: ClusterEmulator, operator: Operator, first_has_ports: bool) -> None:
    """First `flux` (its headless Service is `flux-peers`), then `flux-peers` with inference
    ports (its inference Service is `flux-peers`); or the other way round."""
    first, second = (("flux-peers", "flux") if first_has_ports else ("flux", "flux-peers"))
    await request(cluster, "POST", DOD_PATH, dod(first, ports=first_has_ports))
    owner_uid = live(cluster, DOD_RESOURCE, first)["metadata"]["uid"]
    service = await eventually(lambda: live(cluster, SERVICES, "flux-peers"))
    assert service["metadata"]["ownerReferences"][0]["uid"] == owner_uid
    before = (writes_to(cluster, "services", "flux-peers"), dict(service["spec"]))

    await request(cluster, "POST", DOD_PATH, dod(second, ports=not first_has_ports))
    condition = await eventually(lambda: applied(cluster, second))
    assert (condition["status"], condition["reason"]) == ("False", "NameConflict")
    assert condition["message"] == (
        f"Service {NAMESPACE}/flux-peers belongs to {KIND} {first}; the operator writes no "
        "object it does not control, so this DOD has no children: rename it (its children are "
        "named after it), or delete the other")
    assert dod_status(cluster, second)["message"]

    # A few more reconciles of the second DOD (its watch, its resync timer) write nothing.
    await eventually(lambda: sum(1 for r in list(cluster) if r.resource is not None
                                 and r.resource.plural == "services" and r.name == "flux-peers"
                                 and r.method == "GET") >= 4)
    assert (writes_to(cluster, "services", "flux-peers"), live(cluster, SERVICES, "flux-peers")[
        "spec"]) == before
    assert live(cluster, SERVICES, "flux-peers")["metadata"]["ownerReferences"][0][
        "uid"] == owner_uid
    assert live(cluster, "apps/v1/statefulsets", second) is None
    assert writes_to(cluster, "statefulsets", second) == 0
    assert applied(cluster, first) is None or applied(cluster, first)["status"] == "True"


def test_whose_child_is_it() -> None:
    flux = Owner(name="flux", namespace="ns", uid="u-1")
    peers = Owner(name="flux-peers", namespace="ns", uid="u-2")
    child = {"metadata": child_metadata(flux, "flux-peers")}
    assert foreign_controller(flux, child) is None
    assert foreign_controller(peers, child) == f"{KIND} flux"
    # The DOD `flux` replaced by a new one of the same name: its children are adopted.
    assert foreign_controller(Owner(name="flux", namespace="ns", uid="u-3"), child) is None
    # Rendered without a uid (no owner reference), the label says whose it is.
    unowned = {"metadata": child_metadata(Owner(name="flux", namespace="ns"), "flux-peers")}
    assert foreign_controller(peers, unowned) == f"{KIND} flux"
    # Another controller's object, and one nobody controls or labels: neither is adopted.
    other = {"metadata": {"ownerReferences": [{"kind": "Deployment", "name": "web",
                                               "controller": True, "apiVersion": "apps/v1"}]}}
    assert foreign_controller(peers, other) == "Deployment web"
    assert foreign_controller(peers, {"metadata": {"name": "flux-peers"}}) == UNCONTROLLED
    assert foreign_controller(peers, None) is None


@pytest.mark.parametrize("taken", ["flux", "flux-peers", "flux-fill-secret"])
async def test_a_dod_named_like_an_object_nothing_controls_leaves_it_alone(
        cluster: ClusterEmulator, operator: Operator, taken: str) -> None:
    """Issue 43: a Service (or Secret) of the namespace that no DOD made, named like a child
    of a new DOD, was taken over by server-side apply and, owned by the DOD from then on,
    deleted with it. Now it is a NameConflict like a conflict between two DODs: the DOD gets no
    children, and the object is never written, so it carries no owner reference and the garbage
    collector leaves it when the DOD goes."""
    plural = "secrets" if taken.endswith("-secret") else "services"
    theirs: dict[str, Any] = {"apiVersion": "v1", "metadata": {
        "name": taken, "namespace": NAMESPACE, "labels": {"team": "web"}}}
    if plural == "services":
        theirs |= {"kind": "Service", "spec": {"selector": {"app": "web"}, "ports": [
            {"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}]}}
    else:
        theirs |= {"kind": "Secret", "data": {"token": "d2Vi"}}
    await request(cluster, "POST", f"/api/v1/namespaces/{NAMESPACE}/{plural}", theirs)
    before = dict(live(cluster, f"v1/{plural}", taken) or {})

    await request(cluster, "POST", DOD_PATH, dod("flux", ports=True))
    condition = await eventually(lambda: applied(cluster, "flux"))
    assert (condition["status"], condition["reason"]) == ("False", "NameConflict")
    kind = "Secret" if plural == "secrets" else "Service"
    assert condition["message"].startswith(
        f"{kind} {NAMESPACE}/{taken} exists and no {KIND} controls it; the operator writes no "
        "object it does not control, so this DOD has no children")
    await eventually(lambda: sum(1 for r in list(cluster) if r.resource is not None
                                 and r.resource.plural == plural and r.name == taken
                                 and r.method == "GET") >= 4)
    assert writes_to(cluster, plural, taken) == 0  # (the test's create names no object)
    assert live(cluster, f"v1/{plural}", taken) == before
    assert "ownerReferences" not in before["metadata"]
    assert live(cluster, "apps/v1/statefulsets", "flux") is None

    await request(cluster, "DELETE", f"{DOD_PATH}/flux")
    await eventually(lambda: live(cluster, DOD_RESOURCE, "flux") is None)
    assert writes_to(cluster, plural, taken) == 0
    assert live(cluster, f"v1/{plural}", taken) == before
