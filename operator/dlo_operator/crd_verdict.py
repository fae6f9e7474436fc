"""The API server's verdict on a DiffusionOffloadDeployment, without an API server.

`crd_refusals(document)` does what `kubectl apply` makes the API server do with the CRD:
structural defaulting, strict field validation (unknown fields are refused, as `kubectl apply`
does by default), the OpenAPI schema (types, patterns, bounds, enums) and every CEL rule in
`x-kubernetes-validations` (evaluated with cel-python, typed as the API server types them).
It returns one message per refusal, so that `dlo render` refuses what the cluster refuses and the
operator reports it with the same words. Called by `admission`; the tests use it as their model
of the API server. It must not talk to the cluster.

The CRD is the one `make generate` writes to `crds/`, built in process from the contract's
declarations (`dlo_contract.generate.crd_text`), so an installed operator needs no file.
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Iterator
from typing import Any

import celpy
import jsonschema
import yaml
from celpy import celtypes

from dlo_contract.generate import CRD_NAME, crd_text

CRD_FILE = CRD_NAME
_RULE_ID = re.compile(r"^\[([a-z0-9-]+)\] ")
_SELF_PATH = re.compile(r"self((?:\.[A-Za-z]+)+)(?![\w(])")
"""A field a rule reads, without a method called on it (`self.model.source.startsWith(...)`
reads `model.source`): the memo of `CelRule.holds` is keyed on these fields' values."""


@functools.cache
def load_crd() -> dict[str, Any]:
    return yaml.safe_load(crd_text())


def root_schema(crd: dict[str, Any]) -> dict[str, Any]:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Structural defaulting: fill missing properties that have a default, then descend."""
    if isinstance(value, list) and "items" in schema:
        return [apply_defaults(schema["items"], item) for item in value]
    if not isinstance(value, dict) or "properties" not in schema:
        return value
    out = dict(value)
    for name, sub in schema["properties"].items():
        if name not in out and "default" in sub:
            out[name] = copy.deepcopy(sub["default"])
        if name in out:
            out[name] = apply_defaults(sub, out[name])
    return out


def unknown_fields(schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """Fields the API server would refuse under strict field validation (or else prune)."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    if isinstance(value, list) and "items" in schema:
        return [f for i, item in enumerate(value)
                for f in unknown_fields(schema["items"], item, f"{path}[{i}]")]
    if not isinstance(value, dict) or schema.get("type") != "object":
        return []
    if "additionalProperties" in schema or path == ".metadata":
        return []  # a map, or ObjectMeta (the API server's own schema)
    props = schema.get("properties", {})
    found = [f"{path}.{k}" for k in value if k not in props]
    return found + [f for k, v in value.items() if k in props
                    for f in unknown_fields(props[k], v, f"{path}.{k}")]


def to_cel(schema: dict[str, Any], value: Any) -> Any:
    """JSON to CEL values as the API server types them (`number` fields are doubles)."""
    kind = schema.get("type")
    if isinstance(value, bool):
        return celtypes.BoolType(value)
    if kind == "number":
        return celtypes.DoubleType(float(value))
    if isinstance(value, int):
        return celtypes.IntType(value)
    if isinstance(value, str):
        return celtypes.StringType(value)
    if isinstance(value, list):
        return celtypes.ListType([to_cel(schema.get("items", {}), v) for v in value])
    if isinstance(value, dict):
        props = schema.get("properties", {})
        return celtypes.MapType({celtypes.StringType(k): to_cel(props.get(k, {}), v)
                                 for k, v in value.items()})
    return celpy.json_to_cel(value)


class CelRule:
    """One `x-kubernetes-validations` entry, compiled once, with the fields it reads.
    `where` is the path of the object it applies to ("" for the root, ".spec")."""

    def __init__(self, entry: dict[str, Any], where: str) -> None:
        match = _RULE_ID.match(entry["message"])
        if not match:
            raise ValueError(f"a CEL message must start with [rule-id]: {entry['message']}")
        self.id = match.group(1)
        self.rule = entry["rule"]
        self.message = entry["message"]
        self.where = where
        self.field_path = where + entry.get("fieldPath", "")
        self.paths = tuple(sorted({m.group(1)[1:] for m in _SELF_PATH.finditer(self.rule)}))
        environment = celpy.Environment()
        self._program = environment.program(environment.compile(self.rule))
        self._memo: dict[tuple[Any, ...], bool] = {}

    def holds(self, schema: dict[str, Any], value: dict[str, Any]) -> bool:
        """Evaluate on a defaulted object. A CEL expression depends only on the fields it
        names, so results are memoized on those values."""
        key = tuple(repr(_pick(value, p)) for p in self.paths)
        if key not in self._memo:
            result = self._program.evaluate({"self": to_cel(schema, value)})
            if not isinstance(result, celtypes.BoolType):
                raise TypeError(f"CEL rule {self.id} gave {result!r}, not a bool")
            self._memo[key] = bool(result)
        return self._memo[key]


@functools.cache
def cel_rules() -> tuple[CelRule, ...]:
    """Every CEL rule of the CRD, the root's first, then in schema order."""
    return tuple(rule for where, node in _objects(root_schema(load_crd()))
                 for rule in (CelRule(e, where) for e in node.get("x-kubernetes-validations", ())))


def crd_refusals(document: dict[str, Any]) -> list[str]:
    """What the API server answers to `kubectl apply` of `document`: [] when it is accepted."""
    schema = root_schema(load_crd())
    unknown = unknown_fields(schema, document)
    if unknown:
        return [f"{path[1:]}: unknown field (not in the {document.get('kind')} schema)"
                for path in unknown]
    defaulted = apply_defaults(schema, document)
    validator = jsonschema.Draft4Validator(schema)
    refusals = [_schema_refusal(error)
                for error in sorted(validator.iter_errors(defaulted), key=lambda e: e.path)]
    if refusals:
        return refusals  # the API server runs CEL only on a schema-valid object
    for rule in cel_rules():
        value = _at(defaulted, rule.where)
        if isinstance(value, dict) and not rule.holds(_schema_at(schema, rule.where), value):
            where = f"{rule.field_path[1:]}: " if rule.field_path else ""
            refusals.append(f"{where}{rule.message}")
    return refusals


def _schema_refusal(error: jsonschema.ValidationError) -> str:
    """The validator's words, plus what the field means when a pattern is not matched."""
    message = f"{_dotted(error.absolute_path)}: {error.message}"
    if error.validator == "pattern" and error.schema.get("description"):
        message += f" (expected: {error.schema['description']})"
    return message


def _objects(schema: dict[str, Any], where: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield where, schema
    for name, sub in schema.get("properties", {}).items():
        yield from _objects(sub, f"{where}.{name}")


def _at(value: Any, where: str) -> Any:
    for part in where.split(".")[1:]:
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _schema_at(schema: dict[str, Any], where: str) -> dict[str, Any]:
    for part in where.split(".")[1:]:
        schema = schema["properties"][part]
    return schema


def _dotted(path: Any) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out[1:] or "(root)"


def _pick(value: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value
