"""Every row of the DLO compatibility matrix, accepted or rejected, and the group rule."""

from __future__ import annotations

from typing import Any

import pytest

from dlo_contract.settings import OffloadConfig, ParallelConfig, Settings, SettingsError
from dlo_contract.validation import RULES, GroupChoice, select_group, validate, violated_rules


def make(allgather: bool, quantization: str = "none", **fields: Any) -> Settings:
    """Settings with `use_allgather` and any `offload.*` / `parallel.*` field set by name."""
    offload = {k: v for k, v in fields.items() if k in OffloadConfig.model_fields}
    parallel = {k: v for k, v in fields.items() if k in ParallelConfig.model_fields}
    assert set(offload) | set(parallel) == set(fields), fields
    return Settings(
        offload=OffloadConfig(use_allgather=allgather, **offload),
        parallel=ParallelConfig(**parallel),
        quantization=quantization,
    )


# (matrix row, settings with AllGather, settings without AllGather), and what each must give:
# None = accepted, else the id of the rejecting rule. Mirrors the seed's compatibility table.
MATRIX = [
    ("DP", dict(dp=4), None, None),
    ("SP", dict(sp=2), None, None),
    ("DP+SP", dict(dp=2, sp=2), None, None),
    ("TP>1", dict(tp=2), None, None),
    ("TP>1 with DP", dict(tp=2, dp=2), None, None),
    ("HSDP", dict(hsdp=True), "hsdp-allgather", None),
    ("HSDP+SP", dict(hsdp=True, sp=2), "hsdp-allgather", None),
    ("HSDP+DP", dict(hsdp=True, dp=2), "hsdp-allgather", "hsdp-with-dp-or-tp"),
    ("HSDP+TP", dict(hsdp=True, tp=2), "hsdp-allgather", "hsdp-with-dp-or-tp"),
    ("per-tensor FP8", dict(quantization="fp8_per_tensor"), None, None),
    ("other online quantization", dict(quantization="fp8_per_block"),
     "quantization-allgather", None),
    ("resident leading layers", dict(resident_layers=2), "resident-layers-allgather", None),
    ("runtime cache", dict(enable_runtime_cache=True), "runtime-cache-allgather", None),
    ("runtime cache + registration", dict(enable_runtime_cache=True,
                                          runtime_cache_pin_limit_gib=4.0),
     "runtime-cache-allgather", None),
    ("registration without runtime cache", dict(runtime_cache_pin_limit_gib=4.0),
     "pin-limit-needs-runtime-cache", "pin-limit-needs-runtime-cache"),
    ("runtime cache + FP8", dict(enable_runtime_cache=True, quantization="fp8_per_tensor"),
     "runtime-cache-allgather", "runtime-cache-quantization"),
    ("runtime cache + other quantization", dict(enable_runtime_cache=True, quantization="int8"),
     "quantization-allgather", "runtime-cache-quantization"),
    ("runtime cache + HSDP", dict(enable_runtime_cache=True, hsdp=True),
     "hsdp-allgather", "runtime-cache-hsdp"),
    ("runtime cache + EP", dict(enable_runtime_cache=True, ep=2),
     "runtime-cache-allgather", "runtime-cache-ep"),
    ("runtime cache + CFG parallel", dict(enable_runtime_cache=True, cfg_parallel=2),
     "runtime-cache-allgather", "runtime-cache-cfg-parallel"),
    ("runtime cache + PP", dict(enable_runtime_cache=True, pp=2),
     "runtime-cache-allgather", "runtime-cache-pp"),
    ("runtime cache + TP", dict(enable_runtime_cache=True, tp=2),
     "runtime-cache-allgather", None),
    ("runtime cache + DP + SP", dict(enable_runtime_cache=True, dp=2, sp=2),
     "runtime-cache-allgather", None),
    ("EP, CFG parallel, PP without runtime cache", dict(ep=2, cfg_parallel=2, pp=2), None, None),
]


def _cases():
    for row, fields, with_ag, without_ag in MATRIX:
        fields = dict(fields)
        quant = fields.pop("quantization", "none")
        yield pytest.param(make(True, quant, **fields), with_ag, id=f"{row} / AllGather")
        yield pytest.param(make(False, quant, **fields), without_ag, id=f"{row} / no AllGather")


@pytest.mark.parametrize(("settings", "rejected_by"), list(_cases()))
def test_compatibility_matrix(settings: Settings, rejected_by: str | None) -> None:
    if rejected_by is None:
        assert validate(settings).parallel == settings.parallel
        assert violated_rules(settings) == []
    else:
        assert violated_rules(settings)[0].id == rejected_by
        with pytest.raises(SettingsError, match=rf"\[{rejected_by}\]"):
            validate(settings)


def test_every_rule_is_exercised_by_the_matrix() -> None:
    seen = {r for _, _, a, b in MATRIX for r in (a, b) if r}
    assert seen == {rule.id for rule in RULES}


def test_disabled_dlo_accepts_what_dlo_would_reject() -> None:
    settings = make(True, "int8", resident_layers=2, enable_runtime_cache=True).model_copy(
        update={"offload": OffloadConfig(enabled=False, resident_layers=2,
                                         enable_runtime_cache=True)},
    )
    assert validate(settings) == settings


def test_dlo_takes_priority_over_model_and_layerwise_offload() -> None:
    settings = Settings(offload=OffloadConfig(model_cpu_offload=True, layerwise_cpu_offload=True))
    normalized = validate(settings)
    assert normalized.offload.model_cpu_offload is False
    assert normalized.offload.layerwise_cpu_offload is False
    off = Settings(offload=OffloadConfig(enabled=False, model_cpu_offload=True))
    assert validate(off).offload.model_cpu_offload is True


def test_rejection_message_names_fields_value_and_fix() -> None:
    with pytest.raises(SettingsError) as err:
        validate(make(True, resident_layers=3))
    assert str(err.value) == (
        "invalid settings: offload.resident_layers, offload.use_allgather: "
        "offload.resident_layers=3 needs rank-local blocks [resident-layers-allgather]; "
        "fix: set offload.use_allgather=false or offload.resident_layers=0"
    )


def test_several_violations_are_reported_together() -> None:
    with pytest.raises(SettingsError) as err:
        validate(make(True, "int8", hsdp=True, dp=0))
    message = str(err.value)
    assert "parallel.dp=0 must be greater than 0" in message
    assert "[hsdp-allgather]" in message and "[quantization-allgather]" in message


@pytest.mark.parametrize(
    ("section", "field", "value", "message"),
    [
        ("parallel", "cfg_parallel", 3, "parallel.cfg_parallel=3 must be 1 or 2"),
        ("offload", "resident_layers", -1, "offload.resident_layers=-1 must be 0 or more"),
        ("loader", "readers", 0, "loader.readers=0 must be greater than 0"),
        ("offload", "runtime_cache_lock_timeout_s", 0.0,
         "offload.runtime_cache_lock_timeout_s=0.0 must be greater than 0"),
        ("cache", "max_bytes", -5, "cache.max_bytes=-5 must be 0 or more"),
    ],
)
def test_single_field_bounds(section: str, field: str, value: Any, message: str) -> None:
    settings = Settings.from_dict({section: {field: value}})
    with pytest.raises(SettingsError) as err:
        validate(settings)
    assert str(err.value) == f"invalid settings: {message}"


def test_memory_limit_must_hold_two_chunks() -> None:
    settings = Settings.from_dict({"loader": {"chunk_bytes": 64 << 20,
                                              "memory_limit_bytes": 100 << 20}})
    with pytest.raises(SettingsError, match="must hold two chunks"):
        validate(settings)


@pytest.mark.parametrize(
    ("allgather", "topology", "expected"),
    [
        (True, dict(dp=4, sp=2, tp=2), GroupChoice("dp", 4, allgather_asked=True)),
        (True, dict(dp=1, sp=2, tp=2), GroupChoice("sp", 2, allgather_asked=True)),
        (True, dict(tp=8), GroupChoice("none", 1, allgather_asked=True)),
        (True, dict(), GroupChoice("none", 1, allgather_asked=True)),
        (False, dict(dp=4, sp=2), GroupChoice("none", 1)),
        (False, dict(sp=4), GroupChoice("none", 1)),
    ],
)
def test_group_selection_dp_else_sp_never_tp(allgather, topology, expected) -> None:
    choice = select_group(make(allgather, **topology))
    assert choice == expected
