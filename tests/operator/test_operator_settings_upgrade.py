"""A release of the operator that only adds settings fields (at their defaults) keeps every DOD's
revision: the settings ConfigMap, the pod template and the pods stay, and nothing is prefilled.
A user's edit of such a field, and a release that changes a default, change the revision.

The releases are simulated on one field the operator knows (`ADDED`): the release before it
wrote documents without it and its record did not name it; the release that adds it records it
at its default (`settings_history.record`, what `make generate` writes)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
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

from dlo_contract import settings_history
from dlo_contract.settings import Settings
from dlo_contract.settings_history import SettingsHistory, current_defaults, record
from dlo_operator.configmap import build_configmap, entry_key, revision
from dlo_operator.installation import InstallationConfig
from dlo_operator.naming import Owner
from dlo_operator.spec import parse_spec

ADDED, ADDED_CRD = "loader.peer_timeout_s", "peerTimeoutSeconds"
"""A field standing for one a release adds, and its name in the CR's `spec.loader`."""
SOURCE = "s3://models/flux-v1/"
SPEC = {"replicas": 2, "model": {"source": SOURCE}, "inference": {"image": "server:1"}}
TIMEOUT = 40.0
OWNER = Owner(name="flux", namespace=NAMESPACE, uid="uid-1")
BEFORE = SettingsHistory(always=settings_history.HISTORY.always - {ADDED})


@pytest.fixture
def releases(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """`before()` makes the operator the release without `ADDED`, `adding()` the one that adds
    it, `changing(value)` a later one whose default of it is `value`."""
    full = Settings.to_dict

    def without_added(self: Settings) -> dict[str, Any]:
        data = full(self)
        section, name = ADDED.split(".")
        del data[section][name]
        return data

    def before() -> None:
        monkeypatch.setattr(Settings, "to_dict", without_added)
        monkeypatch.setattr(settings_history, "HISTORY", BEFORE)

    def adding() -> None:
        monkeypatch.setattr(Settings, "to_dict", full)
        monkeypatch.setattr(settings_history, "HISTORY", record(BEFORE))

    def changing(value: Any) -> None:
        monkeypatch.setattr(Settings, "to_dict", full)
        monkeypatch.setattr(settings_history, "HISTORY", record(
            record(BEFORE), {**current_defaults(), ADDED: value}))

    yield {"before": before, "adding": adding, "changing": changing}


def spec_with(**loader: Any) -> Any:
    return parse_spec({**SPEC, "loader": loader} if loader else SPEC)


def test_a_release_adding_a_field_keeps_the_revision_and_the_document(
        releases: dict[str, Any]) -> None:
    releases["before"]()
    old_revision, old_key = revision(spec_with()), entry_key(spec_with())
    releases["adding"]()
    assert (revision(spec_with()), entry_key(spec_with())) == (old_revision, old_key)
    assert revision(spec_with(**{ADDED_CRD: 20})) != old_revision
    assert entry_key(spec_with(**{ADDED_CRD: 20})) == old_key


def test_a_release_changing_a_default_changes_the_revision_of_who_relies_on_it(
        releases: dict[str, Any]) -> None:
    """Its behaviour changes. The document carries the field from then on, also where it holds
    the old default, which a newer reader would otherwise fill with the new one."""
    releases["adding"]()
    relying = revision(spec_with())
    releases["changing"](20.0)
    renders_the_new_default = spec_with(**{ADDED_CRD: 20})
    assert revision(renders_the_new_default) != relying
    assert '"peer_timeout_s": 10.0' in settings_document(spec_with(**{ADDED_CRD: 10}))
    assert entry_key(renders_the_new_default) == entry_key(spec_with())


def settings_document(spec: Any) -> str:
    return str(build_configmap(OWNER, spec)["data"]["settings.json"])


def test_the_entry_key_follows_only_the_fields_that_decide_the_bytes() -> None:
    assert entry_key(spec_with(readers=4)) == entry_key(spec_with())
    assert entry_key(parse_spec({**SPEC, "model": {"source": "s3://models/flux-v2/"}})) != \
        entry_key(spec_with())


def workload_pods(standin: KubeStandIn) -> dict[str, str]:
    """Workload pod name -> uid."""
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in standin.pods()
            if "dlo.dev/role" not in p["metadata"]["labels"]}


def settings_writes(cluster: ClusterEmulator) -> list[tuple[str, str]]:
    """(method, path) of every write to a ConfigMap or a Job."""
    return [(r.method, str(r.url)) for r in list(cluster) if r.resource is not None
            and r.resource.plural in ("configmaps", "jobs")
            and r.method in ("POST", "PATCH", "PUT", "DELETE")]


async def serving(cluster: ClusterEmulator, revision: str = "") -> dict[str, Any]:
    return await eventually(lambda: (s := dod_status(cluster)).get("phase") == "Ready"
                            and s.get("stage") == "Serving" and s.get("updatedReplicas") == 2
                            and s.get("revision") == (revision or s["revision"]) and s,
                            timeout=TIMEOUT)


async def test_an_upgrade_adding_a_field_restarts_no_pod_and_prefills_nothing(
        cluster: ClusterEmulator, releases: dict[str, Any]) -> None:
    standin = KubeStandIn(cluster, nodes=["gpu-0", "gpu-1"], store={SOURCE: 1000})
    task = asyncio.create_task(standin.run())
    memo = kopf.Memo(installation=InstallationConfig())
    try:
        releases["before"]()
        async with operator_with(memo):
            await request(cluster, "POST", DOD_PATH, {
                "apiVersion": "dlo.dev/v1alpha1", "kind": "DiffusionOffloadDeployment",
                "metadata": {"name": "flux", "namespace": NAMESPACE}, "spec": SPEC})
            old = (await serving(cluster))["revision"]
        template = live(cluster, "apps/v1/statefulsets", "flux")["spec"]["template"]
        document = live(cluster, "v1/configmaps", f"flux-settings-{old}")["data"]
        pods, writes = workload_pods(standin), len(settings_writes(cluster))

        releases["adding"]()  # helm upgrade to the release that adds the field
        async with operator_with(memo):
            reads = len(list(cluster))
            await eventually(lambda: len(list(cluster)) > reads + 20)  # it reconciled on
            assert (await serving(cluster))["revision"] == old
            assert live(cluster, "apps/v1/statefulsets", "flux")["spec"]["template"] == template
            assert live(cluster, "v1/configmaps", f"flux-settings-{old}")["data"] == document
            assert settings_writes(cluster)[writes:] == []  # no ConfigMap, no prefill Job
            assert workload_pods(standin) == pods

            await request(cluster, "PATCH", f"{DOD_PATH}/flux",
                          {"spec": {"loader": {ADDED_CRD: 20}}})
            new = await eventually(lambda: (rev := dod_status(cluster).get("revision")) != old
                                   and rev, timeout=TIMEOUT)
            await serving(cluster, new)
            changed = live(cluster, "v1/configmaps", f"flux-settings-{new}")["data"]
            assert '"peer_timeout_s": 20.0' in changed["settings.json"]
            assert set(workload_pods(standin).values()).isdisjoint(pods.values())
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
