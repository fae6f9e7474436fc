"""The table of bad CRs (`support.bad_crs`) through all three paths: the CRD's schema and CEL
rules (what `kubectl apply` answers), `dlo render`, and the operator in the API emulator. All
three refuse each row (the CRD only where the row says so) and the operator says word for word
what `dlo render` says."""

from __future__ import annotations

import pytest
from support.bad_crs import GOOD_SPEC, NAMESPACE, ROWS, BadCR
from support.crd_schema import crd_refusals
from support.operator_harness import (
    DOD_PATH,
    DOD_RESOURCE,
    ClusterEmulator,
    Operator,
    eventually,
    live,
    request,
)

from dlo_contract.validation import RULES
from dlo_operator.errors import SpecError
from dlo_operator.render import render_document

IDS = [row.id for row in ROWS]


def render_refusal(row: BadCR) -> str:
    with pytest.raises(SpecError) as info:
        list(render_document(row.document(), NAMESPACE))
    prefix = f"{NAMESPACE}/{row.document()['metadata']['name']}: "
    assert str(info.value).startswith(prefix)
    return str(info.value)[len(prefix):]


def test_the_table_covers_the_whole_compatibility_matrix() -> None:
    assert {rule.id for rule in RULES} <= set(IDS)
    assert len(set(IDS)) == len(IDS)


def test_the_good_spec_passes_every_path() -> None:
    good = BadCR("good")
    assert crd_refusals(good.document()) == []
    assert [m["kind"] for m in render_document(good.document(), NAMESPACE)] == [
        "ConfigMap", "ConfigMap", "Service", "StatefulSet", "NetworkPolicy", "Secret"]
    assert GOOD_SPEC["replicas"] == 2


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_the_crd_refuses_what_kubectl_apply_would(row: BadCR) -> None:
    refusals = crd_refusals(row.document())
    if row.crd:
        assert any(row.expect in refusal for refusal in refusals), refusals
    else:
        assert refusals == []


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_render_refuses_with_the_same_words(row: BadCR) -> None:
    message = render_refusal(row)
    assert row.expect in message
    if row.crd:
        assert message == "; ".join(crd_refusals(row.document()))


async def test_the_operator_reports_every_row_as_render_does(
        cluster: ClusterEmulator, operator: Operator) -> None:
    for row in ROWS:
        await request(cluster, "POST", DOD_PATH, row.document())

    def refused(row: BadCR) -> dict[str, str] | None:
        status = live(cluster, DOD_RESOURCE, row.document()["metadata"]["name"]).get("status")
        return next((c for c in (status or {}).get("conditions", ()) if c["type"] == "Valid"),
                    None)

    for row in ROWS:
        valid = await eventually(lambda row=row: refused(row))
        assert (valid["status"], valid["reason"]) == ("False", "SpecInvalid"), row.id
        assert valid["message"] == render_refusal(row), row.id
    assert not [r for r in list(cluster) if r.resource is not None
                and r.resource.plural in ("configmaps", "services", "statefulsets", "jobs",
                                          "poddisruptionbudgets")
                and r.method in ("POST", "PATCH", "PUT", "DELETE")]  # watches are fine
