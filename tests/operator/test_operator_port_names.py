"""A container port's name is at most 15 characters ([inference-ports-valid]): the API server
refuses a 16th, and a StatefulSet it refuses leaves the DOD without pods, so the boundary is
checked on both sides, through `dlo render` (the operator's own judgement)."""

from __future__ import annotations

from typing import Any

import pytest

from dlo_operator.errors import SpecError
from dlo_operator.render import render_document

FIFTEEN = "inference-metri"
SIXTEEN = "inference-metric"


def render(ports: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    document = {"apiVersion": "dlo.dev/v1alpha1", "kind": "DiffusionOffloadDeployment",
                "metadata": {"name": "flux"},
                "spec": {"model": {"source": "s3://models/flux/"},
                         "inference": {"image": "server:1", "ports": ports}}}
    return {f"{m['kind']}/{m['metadata']['name']}": m for m in render_document(document, "ml")}


def test_a_port_name_of_fifteen_characters_is_passed_through() -> None:
    assert len(FIFTEEN) == 15
    children = render([{"name": FIFTEEN, "containerPort": 8000}])
    container = children["StatefulSet/flux"]["spec"]["template"]["spec"]["containers"][0]
    assert {"name": FIFTEEN, "containerPort": 8000} in [
        {k: p[k] for k in ("name", "containerPort")} for p in container["ports"]]
    assert [p["name"] for p in children["Service/flux"]["spec"]["ports"]] == [FIFTEEN]


def test_a_port_name_of_sixteen_characters_is_refused_naming_the_item() -> None:
    assert len(SIXTEEN) == 16
    with pytest.raises(SpecError) as info:
        render([{"name": "http", "containerPort": 8000}, {"name": SIXTEEN, "containerPort": 9000}])
    assert str(info.value) == (
        "ml/flux: [inference-ports-valid] spec.inference.ports[1].name='inference-metric' is not "
        "a port name; use at most 15 lowercase letters, digits and '-', with a letter, no '-' at "
        "either end and no '--'")
