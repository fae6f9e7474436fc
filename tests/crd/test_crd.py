"""The CRD: valid for Kubernetes 1.29-1.37, structural and documented, defaults equal to the
operator's, and every example CR valid against its own schema."""

from __future__ import annotations

from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from support.crd_schema import (
    CRD_PATH,
    EXAMPLES,
    apply_defaults,
    crd_refusals,
    load_crd,
    root_schema,
    unknown_fields,
)
from support.source_specs import SCHEME_SPECS

from dlo_operator.spec import CR_LEAVES, parse_spec, settings_from_spec
from dlo_contract.settings import Settings
from dlo_contract.validation import range_errors

CRD = load_crd()
SCHEMA = root_schema(CRD)
SPEC_SCHEMA = SCHEMA["properties"]["spec"]
MINIMAL = {"model": {"source": "s3://models/m/"}, "inference": {"image": "server:1"}}


@pytest.mark.parametrize("version", [f"1.{minor}" for minor in range(29, 38)])
def test_crd_is_a_valid_object_for(version: str) -> None:
    assert kubernetes_validate.validate(CRD, version, strict=True) == version


def test_names_scope_printer_columns_status_and_scale_subresources() -> None:
    spec = CRD["spec"]
    assert (spec["group"], spec["scope"], spec["names"]["shortNames"]) == (
        "dlo.dev", "Namespaced", ["dod"])
    version = spec["versions"][0]
    assert (version["name"], version["subresources"]) == ("v1alpha1", {"status": {}, "scale": {
        "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector"}})  # `kubectl scale dod NAME --replicas N`
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert {"selector", "revision", "stage", "prefill"} <= set(status)
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Phase", "Ready", "Cache", "Progress", "Revision", "Stage", "Message", "Age"]
    assert [c.get("priority", 0) for c in version["additionalPrinterColumns"]] == [
        0, 0, 0, 0, 0, 0, 1, 0]  # the message is shown by `kubectl get -o wide`


def _walk(schema: dict[str, Any], path: str):
    yield path, schema
    for name, sub in schema.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{name}")
    if "items" in schema:
        yield from _walk(schema["items"], f"{path}[]")


def test_schema_is_structural_and_every_field_is_described() -> None:
    for path, node in _walk(SCHEMA, ""):
        if path == ".metadata":
            continue
        assert "type" in node, f"{path} has no type"
        assert node.get("description") or path.endswith("[]"), f"{path} has no description"


def test_every_optional_spec_field_has_a_default() -> None:
    def check(schema: dict[str, Any], path: str) -> None:
        required = set(schema.get("required", ()))
        for name, sub in schema.get("properties", {}).items():
            assert name in required or "default" in sub, f"spec{path}.{name} has no default"
            if sub.get("type") == "object" and "properties" in sub:
                check(sub, f"{path}.{name}")
    check(SPEC_SCHEMA, "")


def test_crd_defaults_are_the_operator_defaults() -> None:
    defaulted = apply_defaults(SPEC_SCHEMA, MINIMAL)
    assert parse_spec(defaulted) == parse_spec(MINIMAL)
    assert settings_from_spec(defaulted) == Settings.from_dict(
        {"loader": {"source": "s3://models/m/"}})


def test_every_declared_field_has_its_place_in_the_schema() -> None:
    for leaf in CR_LEAVES:
        node = SPEC_SCHEMA
        for part in leaf.meta.crd.split("."):
            node = node["properties"][part]
        assert node["description"]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_validates_against_the_crd_schema(example) -> None:
    document = yaml.safe_load(example.read_text())
    jsonschema.Draft4Validator(SCHEMA).validate(document)
    assert unknown_fields(SCHEMA, document) == []
    parse_spec(apply_defaults(SPEC_SCHEMA, document["spec"]))


def test_unknown_fields_would_be_pruned() -> None:
    document = {"spec": {**MINIMAL, "offload": {"useAllGather": False}}}
    assert unknown_fields(SCHEMA, document) == [".spec.offload.useAllGather"]


@pytest.mark.parametrize(("cr_path", "value"), [
    ("parallel.dp", 0), ("parallel.sp", 0), ("parallel.tp", 0), ("parallel.pp", 0),
    ("parallel.ep", 0), ("parallel.cfgParallel", 3), ("offload.residentLayers", -1),
    ("offload.runtimeCachePinLimitGiB", -0.5), ("offload.runtimeCacheLockTimeoutSeconds", 0),
    ("loader.readers", 0), ("loader.chunkBytes", 0), ("loader.memoryLimitBytes", 0),
    ("loader.maxRetries", 0), ("loader.rendezvousTimeoutSeconds", 0),
    ("loader.timeoutSeconds", 0), ("cache.maxBytes", -1), ("cache.minFreeBytes", -1),
    ("quantization", ""),
])
def test_schema_bounds_reject_what_the_validator_rejects(cr_path: str, value: Any) -> None:
    spec = apply_defaults(SPEC_SCHEMA, MINIMAL)
    section, _, name = cr_path.rpartition(".")
    (spec[section] if section else spec)[name] = value
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft4Validator(SPEC_SCHEMA).validate(spec)
    assert range_errors(settings_from_spec(spec))


def test_the_crd_render_and_the_operator_judge_by_is_the_installed_one() -> None:
    assert load_crd() == yaml.safe_load(CRD_PATH.read_text())


@pytest.mark.parametrize("case", SCHEME_SPECS)
def test_each_source_scheme_passes_the_crd_schema_and_its_cel_rules(case: str) -> None:
    """What `kubectl apply` answers to a DOD of each scheme, with its credentials or share."""
    document = {"apiVersion": "dlo.dev/v1alpha1", "kind": "DiffusionOffloadDeployment",
                "metadata": {"name": "flux", "namespace": "ml"}, "spec": SCHEME_SPECS[case]}
    jsonschema.Draft4Validator(SCHEMA).validate(document)
    assert crd_refusals(document) == []
