"""CR spec parsing: camelCase fields into the settings document, defaults, exact errors."""

from __future__ import annotations

import pytest

from dlo_operator.errors import SpecError
from dlo_operator.spec import DEFAULT_LOADER_IMAGE, parse_spec
from dlo_contract.settings import Settings

MINIMAL = {"model": {"source": "s3://models/flux/"}, "inference": {"image": "server:1"}}


def test_minimal_spec_takes_the_settings_defaults() -> None:
    spec = parse_spec(MINIMAL)
    assert spec.settings == Settings.from_dict({"loader": {"source": "s3://models/flux/"}})
    assert (spec.replicas, spec.gpus_per_pod, spec.loader.image) == (1, 1, DEFAULT_LOADER_IMAGE)
    assert spec.automount_service_account_token is False


def test_every_camel_case_field_reaches_the_settings_document() -> None:
    spec = parse_spec({
        **MINIMAL,
        "model": {"source": "s3://b/p/", "include": ["*.safetensors"], "endpointUrl": "http://s3",
                  "region": "eu-west-1", "pathStyle": True},
        "parallel": {"dp": 1, "sp": 4, "tp": 1, "hsdp": True, "cfgParallel": 2, "pp": 1, "ep": 1},
        "offload": {"useAllgather": False, "residentLayers": 3,
                    "runtimeCacheLockTimeoutSeconds": 30, "modelCpuOffload": True},
        "quantization": "int8",
        "cache": {"hostPath": "/mnt/cache", "maxBytes": 10, "minFreeBytes": 5, "verify": "full"},
        "loader": {"mode": "single-reader", "readers": 4, "chunkBytes": 1024,
                   "rendezvousTimeoutSeconds": 9, "onRendezvousTimeout": "fail",
                   "memoryLimitBytes": 4096, "backend": "nccl", "maxRetries": 2,
                   "stallTimeoutSeconds": 7, "timeoutSeconds": 60, "metricsPort": 9500},
    })
    doc = spec.settings.to_dict()
    assert doc["loader"] == {
        "source": "s3://b/p/", "include": ["*.safetensors"], "endpoint_url": "http://s3",
        "region": "eu-west-1", "path_style": True, "mode": "single-reader", "readers": 4,
        "chunk_bytes": 1024, "rendezvous_timeout_s": 9.0, "on_rendezvous_timeout": "fail",
        "memory_limit_bytes": 4096, "backend": "nccl", "max_retries": 2, "stall_timeout_s": 7.0,
        "timeout_s": 60.0, "metrics_port": 9500, "peer_timeout_s": 10.0,
        "peer_serve_bytes_per_second": 268435456}
    assert doc["parallel"] == {"dp": 1, "sp": 4, "tp": 1, "hsdp": True, "cfg_parallel": 2,
                               "pp": 1, "ep": 1}
    assert (doc["offload"]["resident_layers"], doc["quantization"], doc["cache"]["root"]) == (
        3, "int8", "/mnt/cache")
    # DLO takes priority over model-level offload: the validator turns it off.
    assert doc["offload"]["model_cpu_offload"] is False


def test_empty_optional_strings_mean_unset() -> None:
    spec = parse_spec({**MINIMAL, "model": {"source": "s3://b/p/", "endpointUrl": "",
                                            "region": ""}, "offload": {"runtimeCacheRoot": ""}})
    assert (spec.settings.loader.endpoint_url, spec.settings.loader.region,
            spec.settings.offload.runtime_cache_root) == (None, None, None)


@pytest.mark.parametrize(("spec", "message"), [
    ({**MINIMAL, "offload": {"residentLayers": 2}},
     "invalid settings: spec.offload.residentLayers, spec.offload.useAllgather: "
     "spec.offload.residentLayers=2 needs rank-local blocks [resident-layers-allgather]; "
     "fix: set spec.offload.useAllgather=false or spec.offload.residentLayers=0"),
    ({**MINIMAL, "loader": {"mode": "fastest"}},
     "spec.loader.mode: 'fastest' is not one of 'multi-reader', 'single-reader', "
     "'independent'"),
    ({"inference": {"image": "server:1"}},
     "spec.model.source is required: the URI of the checkpoint prefix (s3://, file:///, gs://, "
     "az://, https:// or hf://)"),
    ({"model": {"source": "s3://b/p/"}},
     "spec.inference.image is required: the image of the inference server"),
    ({**MINIMAL, "replicas": 0}, "spec.replicas=0 must be greater than 0"),
])
def test_invalid_specs_fail_with_the_validator_message(spec: dict, message: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec(spec)
    assert str(info.value) == message
