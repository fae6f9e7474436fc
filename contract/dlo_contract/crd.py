"""The CRD's `spec` schema and the README configuration reference, built from the declarations.

`spec_schema()` turns every `setting(...)` of `DeploymentSpec` (which holds the settings document)
into a structural OpenAPI v3 node at its CR path: type, default, bounds, pattern, description and
the `x-kubernetes-*` markers of Kubernetes core objects. `build_crd()` merges it with the
hand-written parts in `crd_base.yaml` (names, printer columns, subresources, status schema, and
the CEL rules keyed by the validator's rule ids). `reference_table()` is the README's table.
Pure functions of their arguments; `dlo_contract.generate` writes the files. Torch-free.
"""

from __future__ import annotations

import copy
import json
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from dlo_contract.deployment import CR_SECTIONS, DeploymentSpec
from dlo_contract.schema import Leaf, base_type, default_of, leaves, plain
from dlo_contract.validation import LOADER_MEMORY_RULE, RULES, cr_names

BASE_PATH = Path(__file__).with_name("crd_base.yaml")
GENERATED = "GENERATED"
NESTED_OBJECTS_DEPTH = 3
"""README rows descend this many levels (`spec.model.credentials.secretName`)."""


def leaf_schema(leaf: Leaf) -> dict[str, Any]:
    """The OpenAPI node of one declared field."""
    annotation = base_type(leaf.annotation)
    origin = typing.get_origin(annotation)
    node: dict[str, Any]
    if origin is Literal:
        values = list(typing.get_args(annotation))
        node = {"type": _json_type(type(values[0])), "enum": values}
    elif origin is tuple:
        item = typing.get_args(annotation)[0]
        node = {"type": "array", "items": _item_schema(item)}
    elif origin is dict:
        value_type = typing.get_args(annotation)[1]
        node = {"type": "object"}
        if value_type is str:
            node["additionalProperties"] = {"type": "string"}
        else:
            node["x-kubernetes-preserve-unknown-fields"] = True
    else:
        node = {"type": _json_type(annotation)}
    if leaf.meta.int64:
        node["format"] = "int64"
    node.update(_bounds(leaf, node["type"]))
    if not leaf.meta.required:
        default = plain(default_of(leaf.info))
        node["default"] = "" if default is None and leaf.meta.empty_is_none else default
    node["description"] = leaf.info.description
    return node


def _json_type(python_type: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string"}[python_type]


def _item_schema(item: Any) -> dict[str, Any]:
    if item is str:
        return {"type": "string"}
    return {"type": "object", "x-kubernetes-preserve-unknown-fields": True}


def _bounds(leaf: Leaf, kind: str) -> dict[str, Any]:
    bounds = leaf.meta.bounds
    out: dict[str, Any] = {}
    if bounds.above is not None:
        if kind == "integer":
            out["minimum"] = int(bounds.above) + 1
        else:
            out.update(exclusiveMinimum=True, minimum=bounds.above)
    if bounds.minimum is not None:
        out["minimum"] = bounds.minimum
    if bounds.maximum is not None:
        out["maximum"] = bounds.maximum
    if bounds.one_of is not None:
        out["enum"] = list(bounds.one_of)
    if bounds.min_length is not None:
        out["minLength"] = bounds.min_length
    if bounds.max_items is not None:
        out["maxItems"] = bounds.max_items
    if bounds.pattern is not None:
        out["pattern"] = bounds.pattern
    return out


def spec_schema(model: type[BaseModel] = DeploymentSpec,
                sections: dict[str, str] = CR_SECTIONS) -> dict[str, Any]:
    """The structural schema of the CR's `spec`, without its CEL rules."""
    root: dict[str, Any] = {"type": "object", "description": sections[""], "properties": {}}
    for leaf in leaves(model):
        if leaf.meta.crd is None:
            continue
        *parents, name = leaf.meta.crd.split(".")
        node, path = root, ""
        for parent in parents:
            path = f"{path}.{parent}" if path else parent
            node = node["properties"].setdefault(parent, {
                "type": "object", "description": sections[path], "properties": {}})
        node["properties"][name] = leaf_schema(leaf)
    _mark_required(root)
    return root


def _mark_required(node: dict[str, Any]) -> bool:
    """List required children (a field declared `required`, or an object holding one) and give
    every optional object `default: {}` so that the API server fills its fields' defaults.
    Returns whether `node` is required itself."""
    required = []
    for name, child in node.get("properties", {}).items():
        if "properties" in child:
            if _mark_required(child):
                required.append(name)
            else:
                child["default"] = {}
                child["properties"] = child.pop("properties")  # keep the fields last
        elif "default" not in child:
            required.append(name)
    if required:
        node["required"] = required
        node["properties"] = node.pop("properties")  # `required` before the fields
    return bool(required)


def cel_rules(base_rules: dict[str, dict[str, str]]) -> list[dict[str, str]]:
    """The spec's `x-kubernetes-validations` from the hand-written rules keyed by rule id, in
    the validator's order; a rule id the validator lacks (or the reverse) is an error."""
    fixes = {rule.id: rule.fix(cr_names) for rule in RULES}
    expected = [rule.id for rule in RULES] + [LOADER_MEMORY_RULE]
    if list(base_rules) != expected:
        raise ValueError(f"CEL rules {list(base_rules)} do not match the validator's {expected}")
    out = []
    for rule_id, rule in base_rules.items():
        fix = rule.get("fix") or fixes[rule_id]
        out.append({"rule": rule["rule"], "message": f"[{rule_id}] {rule['message']}; fix: {fix}",
                    "fieldPath": rule["fieldPath"]})
    return out


def build_crd(base: dict[str, Any], model: type[BaseModel] = DeploymentSpec) -> dict[str, Any]:
    """The whole CRD: `base["crd"]` with the generated spec schema and the CEL rules."""
    crd = copy.deepcopy(base["crd"])
    properties = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    if properties.get("spec") != GENERATED:
        raise ValueError("crd_base.yaml must hold `spec: GENERATED` in openAPIV3Schema")
    schema = spec_schema(model)
    pod_rules = [{"rule": rule["rule"], "message": f"[{rule_id}] {rule['message']}",
                  "fieldPath": rule["fieldPath"]}
                 for rule_id, rule in base.get("podCelRules", {}).items()]
    rules = {"x-kubernetes-validations": cel_rules(base["celRules"]) + pod_rules}
    properties["spec"] = {key: value for key, value in schema.items() if key != "properties"} \
        | rules | {"properties": schema["properties"]}
    return crd


def reference_rows(schema: dict[str, Any], prefix: str = "spec") -> Iterable[str]:
    """One table row per leaf field (Kubernetes core types such as `resources` stay one row)."""
    for name, field in schema.get("properties", {}).items():
        path = f"{prefix}.{name}"
        if "properties" in field and path.count(".") < NESTED_OBJECTS_DEPTH:
            yield from reference_rows(field, path)
            continue
        default = json.dumps(field["default"]) if "default" in field else "required"
        allowed = f" One of: {', '.join(map(str, field['enum']))}." if "enum" in field else ""
        description = " ".join(field.get("description", "").split())
        yield (f"| `{path}` | {field.get('type', 'object')} | `{default}` | "
               f"{description}{allowed} |")


def reference_table(crd: dict[str, Any]) -> str:
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    header = ["| field | type | default | meaning |", "|---|---|---|---|"]
    return "\n".join(header + list(reference_rows(spec)))
