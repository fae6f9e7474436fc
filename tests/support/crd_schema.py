"""What the API server does with the CRD's schema, for the tests: defaulting, pruning checks and
CEL evaluation (with cel-python), so the tests can judge a CR as `kubectl apply` would."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import celpy
import yaml
from celpy import celtypes

ROOT = Path(__file__).parents[2]
CRD_PATH = ROOT / "crds" / "dlo.dev_diffusionoffloaddeployments.yaml"
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
_ID = re.compile(r"^\[([a-z0-9-]+)\] ")
_SELF_PATH = re.compile(r"self((?:\.[A-Za-z]+)+)")


def load_crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


def root_schema(crd: dict[str, Any]) -> dict[str, Any]:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Structural defaulting: fill missing properties that have a default, then descend."""
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
    """Fields the API server would prune (not in the schema, no preserve-unknown-fields)."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    if isinstance(value, list) and "items" in schema:
        return [f for i, item in enumerate(value)
                for f in unknown_fields(schema["items"], item, f"{path}[{i}]")]
    if not isinstance(value, dict) or schema.get("type") != "object":
        return []
    if "additionalProperties" in schema:
        return []
    props = schema.get("properties", {})
    if path == ".metadata":
        return []  # ObjectMeta: the API server's own schema
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
    """One `x-kubernetes-validations` entry, compiled once, with the fields it reads."""

    def __init__(self, entry: dict[str, Any]) -> None:
        match = _ID.match(entry["message"])
        assert match, f"CEL message must start with [rule-id]: {entry['message']}"
        self.id = match.group(1)
        self.rule = entry["rule"]
        self.paths = tuple(sorted({m.group(1)[1:] for m in _SELF_PATH.finditer(self.rule)}))
        environment = celpy.Environment()
        self._program = environment.program(environment.compile(self.rule))
        self._memo: dict[tuple[Any, ...], bool] = {}

    def holds(self, spec_schema: dict[str, Any], spec: dict[str, Any]) -> bool:
        """Evaluate on a defaulted spec. A CEL expression depends only on the fields it names,
        so results are memoized on those values."""
        key = tuple(repr(_pick(spec, p)) for p in self.paths)
        if key not in self._memo:
            result = self._program.evaluate({"self": to_cel(spec_schema, spec)})
            assert isinstance(result, celtypes.BoolType), f"{self.id}: {result!r}"
            self._memo[key] = bool(result)
        return self._memo[key]


def cel_rules(crd: dict[str, Any]) -> list[CelRule]:
    spec_schema = root_schema(crd)["properties"]["spec"]
    return [CelRule(entry) for entry in spec_schema["x-kubernetes-validations"]]


def _pick(value: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        value = value[part]
    return value
