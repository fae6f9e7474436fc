"""The DOD's fill Secret in the cluster (issue 43): created by the operator with random bytes
before any other child, owned by the DOD, and never written again by a reconcile, a spec change
or an operator restart; a Secret someone deleted comes back with new bytes."""

from __future__ import annotations

import base64
import string
from typing import Any

from support.operator_harness import (
    DOD_PATH,
    DOD_RESOURCE,
    NAMESPACE,
    ClusterEmulator,
    Operator,
    eventually,
    live,
    request,
)

from dlo_contract.names import FILL_SECRET_KEY
from dlo_operator.naming import KIND, fill_secret_name

SECRETS = "v1/secrets"
SECRET = fill_secret_name("flux")


def dod(**spec: Any) -> dict[str, Any]:
    return {"apiVersion": "dlo.dev/v1alpha1", "kind": KIND,
            "metadata": {"name": "flux", "namespace": NAMESPACE},
            "spec": {"replicas": 2, "model": {"source": "s3://models/flux/"},
                     "inference": {"image": "server:1"}, **spec}}


def secret_bytes(cluster: ClusterEmulator) -> bytes | None:
    found = live(cluster, SECRETS, SECRET)
    return base64.b64decode(found["data"][FILL_SECRET_KEY]) if found else None


def writes(cluster: ClusterEmulator, plural: str) -> list[str]:
    """The operator's writes to objects of `plural` (method and object name, in order)."""
    return [f"{r.method.value} {r.name or (r.data or {}).get('metadata', {}).get('name')}"
            for r in list(cluster) if r.resource is not None and r.resource.plural == plural
            and r.method in ("POST", "PATCH", "PUT", "DELETE")
            and r.headers.get("User-Agent") != "dlo-tests"]


def secret_reads(cluster: ClusterEmulator) -> int:
    return sum(1 for r in list(cluster) if r.resource is not None and r.method == "GET"
               and r.resource.plural == "secrets" and r.name == SECRET)


async def reconciles(cluster: ClusterEmulator, count: int) -> None:
    """Wait for `count` more reconciles (each reads the Secret once)."""
    start = secret_reads(cluster)
    await eventually(lambda: secret_reads(cluster) >= start + count)


async def test_the_fill_secret_is_created_once_and_never_rotated(
        cluster: ClusterEmulator, operator: Operator) -> None:
    await request(cluster, "POST", DOD_PATH, dod())
    first = await eventually(lambda: secret_bytes(cluster))
    secret = live(cluster, SECRETS, SECRET)
    owner = live(cluster, DOD_RESOURCE, "flux")["metadata"]["uid"]
    assert [(r["kind"], r["uid"], r["controller"]) for r in secret["metadata"][
        "ownerReferences"]] == [(KIND, owner, True)]
    assert (secret["type"], secret["immutable"]) == ("Opaque", True)
    assert len(first) == 64 and set(first.decode()) <= set(string.hexdigits)
    await eventually(lambda: live(cluster, "apps/v1/statefulsets", "flux"))
    # Before any other child, so that no pod waits for it.
    assert writes(cluster, "secrets") == [f"POST {SECRET}"]
    assert not [r for r in list(cluster)[:_index_of_secret_create(cluster)]
                if r.resource is not None and r.method in ("POST", "PATCH")
                and r.resource.plural in ("configmaps", "services", "statefulsets")]

    await reconciles(cluster, 3)
    await request(cluster, "PATCH", f"{DOD_PATH}/flux", {"spec": {
        "model": {"source": "s3://models/flux-2/"}, "offload": {"useAllgather": False}}})
    await eventually(lambda: live(cluster, DOD_RESOURCE, "flux")["status"][
        "observedGeneration"] == 2)
    await reconciles(cluster, 3)
    await operator.stop()
    await operator.start()
    await reconciles(cluster, 2)
    assert secret_bytes(cluster) == first
    assert writes(cluster, "secrets") == [f"POST {SECRET}"]

    # Deleted by someone: created again, with new bytes (the loaders then fill again).
    await request(cluster, "DELETE", f"/api/v1/namespaces/{NAMESPACE}/secrets/{SECRET}")
    again = await eventually(lambda: secret_bytes(cluster))
    assert again != first
    assert writes(cluster, "secrets") == [f"POST {SECRET}"] * 2


def _index_of_secret_create(cluster: ClusterEmulator) -> int:
    return next(i for i, r in enumerate(list(cluster)) if r.resource is not None
                and r.resource.plural == "secrets" and r.method == "POST")


async def test_a_replaced_dod_takes_its_secret_over_without_rewriting_its_bytes(
        cluster: ClusterEmulator, operator: Operator) -> None:
    """A DOD deleted and created again under the same name finds its predecessor's Secret
    (the garbage collector has not removed it yet): the owner reference moves to the new DOD by
    a metadata patch, and the bytes stay."""
    await request(cluster, "POST", DOD_PATH, dod())
    first = await eventually(lambda: secret_bytes(cluster))
    await request(cluster, "DELETE", f"{DOD_PATH}/flux")
    await eventually(lambda: live(cluster, DOD_RESOURCE, "flux") is None)
    await request(cluster, "POST", DOD_PATH, dod())
    uid = await eventually(lambda: live(cluster, DOD_RESOURCE, "flux")["metadata"]["uid"])
    await eventually(lambda: live(cluster, SECRETS, SECRET)["metadata"]["ownerReferences"][0][
        "uid"] == uid)
    assert secret_bytes(cluster) == first
    assert writes(cluster, "secrets") == [f"POST {SECRET}", f"PATCH {SECRET}"]


async def test_a_secret_rendered_without_data_and_applied_by_hand_is_replaced(
        cluster: ClusterEmulator, operator: Operator) -> None:
    """`dlo render | kubectl apply` makes the Secret without data (the render never holds
    one): the DOD's operator writes its random bytes into it, once."""
    rendered = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                "metadata": {"name": SECRET, "namespace": NAMESPACE,
                             "labels": {"dlo.dev/deployment": "flux"}}}
    await request(cluster, "POST", f"/api/v1/namespaces/{NAMESPACE}/secrets", rendered)
    await request(cluster, "POST", DOD_PATH, dod())
    first = await eventually(lambda: secret_bytes(cluster))
    assert len(first) == 64 and live(cluster, SECRETS, SECRET)["immutable"] is True
    await reconciles(cluster, 3)
    assert secret_bytes(cluster) == first
    assert writes(cluster, "secrets") == [f"PATCH {SECRET}"]
