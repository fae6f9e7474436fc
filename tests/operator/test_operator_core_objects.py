"""The core/v1 objects a DOD passes to its children are refused where the API server would
refuse the children (issue 35): every such field is checked against its Kubernetes schema, and
the rules the schema cannot say hold. The bad specs themselves are rows of `support.bad_crs`,
refused by `dlo render` and the operator alike (test_operator_bad_crs.py); here: the coverage of
the field table, the good specs staying good, and the quantity grammar."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from support.bad_crs import ROWS

from dlo_operator.core_rules import core_problems, quantity
from dlo_operator.core_schema import CORE_FIELDS
from dlo_operator.manifests import build_children
from dlo_operator.naming import Owner
from dlo_operator.spec import CR_LEAVES, parse_spec

EXAMPLES = sorted(Path(__file__).parents[2].joinpath("examples").glob("*.yaml"))
CORE_ROWS = [row for row in ROWS if row.id in {
    "label-key", "label-value", "node-selector-key", "priority-class-name",
    "service-account-name", "toleration-operator", "toleration-seconds-type", "probe-no-handler",
    "probe-unknown-field", "mount-run-dlo", "mount-path-twice", "quantity-cpu",
    "quantity-request-over-limit", "env-no-name", "affinity-malformed", "affinity-operator",
    "volume-name"}]


def test_every_field_described_as_core_v1_is_checked_against_its_schema() -> None:
    described = {leaf.path for leaf in CR_LEAVES if "core/v1" in (leaf.info.description or "")}
    assert described == {field.path for field in CORE_FIELDS}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_the_examples_pass(path: Path) -> None:
    assert core_problems(parse_spec(yaml.safe_load(path.read_text())["spec"])) == []


def test_a_spec_using_every_core_field_well_passes() -> None:
    spec = {"model": {"source": "s3://m/p/"}, "inference": {
        "image": "s:1", "env": [{"name": "A", "value": "1"}, {"name": "POD", "valueFrom": {
            "fieldRef": {"fieldPath": "metadata.name"}}}],
        "resources": {"requests": {"cpu": "500m", "memory": "1.5Gi"}, "limits": {"cpu": "2"}},
        "ports": [{"name": "http", "containerPort": 8000}],
        "readinessProbe": {"httpGet": {"path": "/h", "port": "http"}},
        "startupProbe": {"tcpSocket": {"port": 8000}, "failureThreshold": 60},
        "livenessProbe": {"exec": {"command": ["true"]}},
        "volumeMounts": [{"name": "data", "mountPath": "/data"},
                         {"name": "tmp", "mountPath": "/tmp"}]},
        "loader": {"resources": {"requests": {"cpu": "1"}, "limits": {"memory": "4Gi"}}},
        "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "d"}},
                    {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}}],
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                        {"operator": "Exists"}, {"key": "k", "value": "v", "effect": "NoExecute",
                                                 "tolerationSeconds": 30}],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": "gpu.count", "operator": "Gt", "values": ["4"]}]}]}},
            "podAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 100, "podAffinityTerm": {"topologyKey": "zone", "labelSelector": {
                    "matchExpressions": [{"key": "app", "operator": "In",
                                          "values": ["cache"]}]}}}]}},
        "podLabels": {"example.com/team": "ml", "empty": ""},
        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        "podAnnotations": {"example.com/note": "any text at all", "Example.com/Note": "x"},
        "serviceAccountName": "model-reader", "priorityClassName": "inference.high",
        "imagePullSecrets": [{"name": "regcred"}]}
    assert core_problems(parse_spec(spec)) == []


@pytest.mark.parametrize("row", CORE_ROWS, ids=[row.id for row in CORE_ROWS])
def test_what_is_refused_here_the_children_carry_to_the_api_server(row: Any) -> None:
    """Without the check, each bad field reaches the StatefulSet as written: a structural
    problem is refused by the children's own schema, and the rest only by the API server's
    validation, which no schema states (so it must be written down here)."""
    spec = parse_spec(row.document()["spec"])
    assert core_problems(spec)
    statefulset = next(child for child in build_children(Owner(name="d", namespace="n"), spec)
                       if child["kind"] == "StatefulSet")
    structural = {"toleration-seconds-type", "probe-unknown-field", "env-no-name",
                  "affinity-malformed"}
    if row.id in structural:
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(statefulset, "1.37", strict=True)
    else:
        assert kubernetes_validate.validate(statefulset, "1.37", strict=True) == "1.37"


@pytest.mark.parametrize(("text", "value"), [
    ("2", Decimal(2)), ("500m", Decimal("0.5")), ("16Gi", Decimal(16 << 30)),
    ("1e9", Decimal(10) ** 9), ("1.5k", Decimal(1500)), (8, Decimal(8)), ("100u", Decimal("1E-4")),
    ("lots", None), ("1GB", None), ("", None), ("Gi", None), (True, None)])
def test_quantities_are_read_as_the_api_server_reads_them(text: Any, value: Any) -> None:
    assert quantity(text) == value
