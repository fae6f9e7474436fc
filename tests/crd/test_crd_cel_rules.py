"""The CRD's CEL rules reject exactly what `dlo_contract.validation` rejects, over the whole
compatibility matrix (evaluated with cel-python after the API server's defaulting)."""

from __future__ import annotations

import itertools
from typing import Any

from support.crd_schema import apply_defaults, cel_rules, load_crd, root_schema

from dlo_operator.pod_rules import LOADER_BACKEND_MESSAGE
from dlo_operator.source_access import SHARE_NEEDED_MESSAGE
from dlo_operator.spec import settings_from_spec
from dlo_contract.settings import Settings
from dlo_contract.validation import CR_PATHS, RULES, range_errors, violated_rules

CRD = load_crd()
SPEC_SCHEMA = root_schema(CRD)["properties"]["spec"]
POD_RULES = ("loader-backend-gloo", "source-share")
"""Rules on the pod rather than the settings document (`dlo_operator.pod_rules`)."""
RULES_CEL = [rule for rule in cel_rules(CRD) if rule.id not in POD_RULES]
LOADER_RULE = "loader-memory-two-chunks"
MIB = 1 << 20

# Each bound and the value just past it (a rule `pp > 1` is checked at pp=1 and pp=2; the loader's
# two chunks at exactly half of the default 1 GiB memory limit and one byte more), so a rule
# whose threshold drifts by one disagrees with the validator somewhere in the matrix.
DIMENSIONS: dict[str, tuple[Any, ...]] = {
    "offload.enabled": (True, False),
    "offload.useAllgather": (True, False),
    "parallel.hsdp": (False, True),
    "offload.residentLayers": (0, 1),
    "offload.enableRuntimeCache": (False, True),
    "quantization": ("none", "fp8_per_tensor", "int8_weight_only"),
    "parallel.ep": (1, 2),
    "parallel.cfgParallel": (1, 2),
    "parallel.pp": (1, 2),
    "offload.runtimeCachePinLimitGiB": (0, 0.5),
    "parallel.dp": (1, 2),
    "parallel.tp": (1, 2),
    "parallel.sp": (1, 2),
    "loader.chunkBytes": (512 * MIB, 512 * MIB + 1),
}


BASE_SPEC = apply_defaults(SPEC_SCHEMA, {"model": {"source": "s3://models/m/"},
                                         "inference": {"image": "server:1"}})
BASE_SETTINGS = settings_from_spec(BASE_SPEC)
SETTINGS_PATH = {cr_path: path for path, cr_path in CR_PATHS.items()}


def _spec(values: tuple[Any, ...]) -> dict[str, Any]:
    """The defaulted spec with the matrix values set (defaults only fill what is missing, so
    this equals defaulting the spec the user wrote)."""
    spec = {key: dict(value) if isinstance(value, dict) else value
            for key, value in BASE_SPEC.items()}
    for dotted, value in zip(DIMENSIONS, values):
        section, _, name = dotted.rpartition(".")
        (spec[section] if section else spec)[name] = value
    return spec


def _settings(values: tuple[Any, ...]) -> Settings:
    """The settings document of the same spec, via the operator's field mapping (the JSON
    parsing of the document is tested on its own and is too slow for 24k documents)."""
    sections: dict[str, dict[str, Any]] = {}
    top: dict[str, Any] = {}
    for dotted, value in zip(DIMENSIONS, values):
        section, _, name = SETTINGS_PATH[dotted].rpartition(".")
        (sections.setdefault(section, {}) if section else top)[name] = value
    parts = {name: getattr(BASE_SETTINGS, name).model_copy(update=fields)
             for name, fields in sections.items()}
    return BASE_SETTINGS.model_copy(update={**parts, **top})


def _validator_ids(values: tuple[Any, ...]) -> set[str]:
    settings = _settings(values)
    ids = {rule.id for rule in violated_rules(settings)}
    if any("must hold two chunks" in error for error in range_errors(settings)):
        ids.add(LOADER_RULE)
    return ids


def test_every_validation_rule_has_a_cel_twin() -> None:
    assert [r.id for r in RULES_CEL] == [r.id for r in RULES] + [LOADER_RULE]


def test_pod_rules_in_cel_say_what_the_operator_says() -> None:
    backend, share = [rule for rule in cel_rules(CRD) if rule.id in POD_RULES]
    assert backend.message == LOADER_BACKEND_MESSAGE
    assert share.message == SHARE_NEEDED_MESSAGE


def test_cel_and_the_validator_agree_on_the_whole_matrix() -> None:
    combinations = list(itertools.product(*DIMENSIONS.values()))
    assert len(combinations) == 3 * 2 ** 13
    rejected_by_each = dict.fromkeys([r.id for r in RULES_CEL], 0)
    for values in combinations:
        spec = _spec(values)
        cel_ids = {rule.id for rule in RULES_CEL if not rule.holds(SPEC_SCHEMA, spec)}
        assert cel_ids == _validator_ids(values), dict(zip(DIMENSIONS, values))
        for rule_id in cel_ids:
            rejected_by_each[rule_id] += 1
    # Every rule rejects something in the matrix and none rejects everything.
    assert all(0 < count < len(combinations) for count in rejected_by_each.values()), (
        rejected_by_each)


def test_the_shortcut_builds_the_same_settings_as_the_operator() -> None:
    for values in itertools.islice(itertools.product(*DIMENSIONS.values()), 0, None, 997):
        assert _settings(values) == settings_from_spec(_spec(values))


def test_a_cel_rule_reads_only_spec_fields_that_exist() -> None:
    missing = []
    for rule in RULES_CEL:
        assert rule.paths, rule.id
        for path in rule.paths:
            node = SPEC_SCHEMA
            for part in path.split("."):
                node = node.get("properties", {}).get(part, {})
            if "type" not in node:
                missing.append(f"{rule.id}: {path}")
    assert missing == []


def test_the_share_rule_holds_for_every_scheme_but_a_file_source_without_a_share() -> None:
    (share,) = [rule for rule in cel_rules(CRD) if rule.id == "source-share"]
    verdicts = {}
    for source in ("s3://m/p/", "gs://m/p/", "hf://o/r/", "file:///models/p/"):
        for volume in ("", "weights"):
            spec = apply_defaults(SPEC_SCHEMA, {
                "model": {"source": source, "share": {"volumeName": volume}},
                "inference": {"image": "server:1"}})
            verdicts[source, volume] = share.holds(SPEC_SCHEMA, spec)
    assert [key for key, holds in verdicts.items() if not holds] == [("file:///models/p/", "")]
