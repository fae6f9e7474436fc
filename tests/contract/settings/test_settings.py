"""The settings document: JSON round trip, strict parsing, the one place the env is read."""

from __future__ import annotations

import json

import pydantic
import pytest

from dlo_contract.settings import (
    CacheConfig,
    LoaderConfig,
    OffloadConfig,
    ParallelConfig,
    Settings,
    SettingsError,
    load_settings,
    replace_path,
)


def _custom() -> Settings:
    return Settings(
        offload=OffloadConfig(use_allgather=False, resident_layers=2, enable_runtime_cache=True,
                              runtime_cache_pin_limit_gib=1.5),
        parallel=ParallelConfig(dp=4, sp=2),
        quantization="fp8_per_tensor",
        loader=LoaderConfig(source="s3://models/flux/", include=("transformer/*",),
                            endpoint_url="http://127.0.0.1:9000", path_style=True,
                            mode="single-reader", chunk_bytes=1 << 22),
        cache=CacheConfig(root="/data/cache", max_bytes=10 << 30, verify="full"),
    )


def test_json_round_trip_preserves_every_field() -> None:
    settings = _custom()
    assert Settings.from_json(settings.to_json()) == settings
    assert Settings.from_json(Settings().to_json()) == Settings()


def test_empty_document_means_defaults() -> None:
    assert Settings.from_dict({}) == Settings()
    assert Settings().offload.use_allgather is True
    assert Settings().offload.runtime_cache_lock_timeout_s == 600.0
    assert Settings().loader.chunk_bytes == 16 << 20


def test_unknown_field_is_rejected_with_its_path() -> None:
    with pytest.raises(SettingsError) as err:
        Settings.from_dict({"offload": {"use_allgater": False}})
    assert str(err.value).startswith("settings.offload: unknown field(s) use_allgater; allowed: ")


def test_wrong_type_names_field_and_value() -> None:
    with pytest.raises(SettingsError) as err:
        Settings.from_dict({"parallel": {"dp": "2"}})
    assert str(err.value) == "settings.parallel.dp: expected int, found str '2'"
    with pytest.raises(SettingsError) as err:
        Settings.from_dict({"offload": {"enabled": 1}})
    assert str(err.value) == "settings.offload.enabled: expected bool, found int 1"


def test_enum_fields_list_allowed_values() -> None:
    with pytest.raises(SettingsError) as err:
        Settings.from_dict({"loader": {"mode": "fast"}})
    assert str(err.value) == (
        "settings.loader.mode: 'fast' is not one of 'multi-reader', 'single-reader', 'independent'"
    )


def test_integers_are_accepted_for_float_fields() -> None:
    settings = Settings.from_dict({"offload": {"runtime_cache_pin_limit_gib": 2}})
    assert settings.offload.runtime_cache_pin_limit_gib == 2.0


def test_runtime_cache_root_defaults_to_cache_root() -> None:
    assert Settings(cache=CacheConfig(root="/x")).runtime_cache_root == "/x"
    custom = Settings(offload=OffloadConfig(runtime_cache_root="/y"))
    assert custom.runtime_cache_root == "/y"


def test_load_settings_reads_dlo_config(tmp_path, monkeypatch) -> None:
    path = tmp_path / "settings.json"
    path.write_text(_custom().to_json())
    monkeypatch.setenv("DLO_CONFIG", str(path))
    assert load_settings() == _custom()


def test_load_settings_missing_file_says_how_to_fix(tmp_path) -> None:
    with pytest.raises(SettingsError) as err:
        load_settings(tmp_path / "absent.json")
    assert str(err.value) == f"cannot read settings document {tmp_path / 'absent.json'}: " \
        "No such file or directory"
    assert err.value.hint == "pass --config FILE or set DLO_CONFIG"


def test_invalid_json_is_a_settings_error() -> None:
    with pytest.raises(SettingsError, match="settings document is not valid JSON"):
        Settings.from_json("{")


def test_replace_path_checks_the_new_value() -> None:
    settings = replace_path(Settings(), "loader.readers", 4)
    assert settings.loader.readers == 4
    assert replace_path(settings, "quantization", "int8").quantization == "int8"
    with pytest.raises(SettingsError, match="unknown settings field 'loader.reader'"):
        replace_path(settings, "loader.reader", 4)
    with pytest.raises(SettingsError, match="expected int"):
        replace_path(settings, "loader.readers", "many")


def test_settings_are_frozen() -> None:
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        Settings().quantization = "x"  # type: ignore[misc]


def test_document_is_plain_json() -> None:
    data = json.loads(_custom().to_json())
    assert data["loader"]["include"] == ["transformer/*"]
    assert data["schema_version"] == 1
