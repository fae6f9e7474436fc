"""Every message the runtime writes about a settings field names it as the document's origin
does (see `support.field_names`). Each is driven through the call a server makes (`pod.enable`,
`pod.build_dit`, the backend) where that call reaches it with a tiny DiT on the CPU; registration
over budget and the checkpoint reasons through the unit `pod` hands its namer to.

Not driven here: a group of more than one rank passed while the settings select none (it needs
a second rank; `tests/runtime/test_backend_distributed.py` runs that world)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from diffusers import FluxTransformer2DModel
from dlo_bench.models import tiny_model
from support.fake_cudart import FakeCudart
from support.field_names import ORIGINS, Case, check, text_of
from support.host_helpers import settings_with
from torch import nn

from dlo_contract import names as cross_plane
from dlo_contract.errors import DloError
from dlo_contract.validation import names_for
from dlo_runtime import pod
from dlo_runtime.backend import DistributedLayerwiseOffloadBackend
from dlo_runtime.checkpoint_plan import build_meta_dit, preflight
from dlo_runtime.cuda_registration import CudaRegistrationBackend
from dlo_runtime.host_registration import register_plan
from dlo_runtime.runtime_weight_cache import RuntimeLayout, load_runtime_plan


@dataclass(frozen=True)
class Env:
    flux: nn.Module
    flux_layout: Path
    tmp: Path


def _raised(call) -> str:
    with pytest.raises(DloError) as caught:
        call()
    return text_of(caught.value)


def _settings(origin: str | None, **fields: object):
    return settings_with(**fields).model_copy(update={"origin": origin})


def _backend(origin: str | None, **fields: object) -> str:
    settings = _settings(origin, **fields)
    return _raised(lambda: DistributedLayerwiseOffloadBackend(
        tiny_model("wan"), settings=settings, device="cpu").enable())


def _group_of_one(env: Env, origin: str | None) -> str:
    """A group of one rank passed while the settings select a DP group of two."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        settings = _settings(origin, **{"parallel.dp": 2})
        return _raised(lambda: DistributedLayerwiseOffloadBackend(
            tiny_model("wan"), settings=settings, device="cpu", group=dist.group.WORLD))
    finally:
        dist.destroy_process_group()


def _reason(env: Env, origin: str | None, **fields: object) -> str:
    settings = _settings(origin, **fields)
    dit = build_meta_dit(FluxTransformer2DModel, env.flux_layout / "transformer", torch.float32)
    return preflight(env.flux_layout, dit, settings).reason or ""


def _cache_off(env: Env, origin: str | None) -> str:
    settings = _settings(origin)
    return load_runtime_plan(env.flux, settings, RuntimeLayout(),
                             names=names_for(settings)).reason or ""


def _over_budget(env: Env, origin: str | None) -> str:
    settings = _settings(origin)
    dit = build_meta_dit(FluxTransformer2DModel, env.flux_layout / "transformer", torch.float32)
    plan = preflight(env.flux_layout, dit, settings).plan
    try:
        return register_plan(plan, budget_bytes=1, names=names_for(settings),
                             backend=CudaRegistrationBackend(0, cudart=FakeCudart())).reason
    finally:
        plan.close()


def _entry_wait(env: Env, origin: str | None) -> str:
    document = env.tmp / f"settings-{bool(origin)}.json"
    document.write_text(_settings(origin).to_json())
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(cross_plane.ENTRY_WAIT_ENV, "0.05")
        return _raised(lambda: pod.enable(nn.Linear(1, 1), device="cpu",
                                          settings=pod.load_settings(str(document)),
                                          entry_file=str(env.tmp / "never.json")))


CASES = (
    Case("backend-with-offload-off", ("offload.enabled",),
         lambda env, o: _backend(o, **{"offload.enabled": False})),
    Case("no-group-for-allgather", ("offload.use_allgather",),
         lambda env, o: _backend(o, **{"parallel.dp": 2})),
    Case("group-of-another-size", ("parallel.dp",), _group_of_one),
    Case("resident-layers-leave-nothing", ("offload.resident_layers",),
         lambda env, o: _backend(o, **{"offload.use_allgather": False,
                                       "offload.resident_layers": 3})),
    Case("checkpoint-under-tp", ("parallel.tp",),
         lambda env, o: _reason(env, o, **{"parallel.tp": 2})),
    Case("checkpoint-under-hsdp", ("parallel.hsdp",),
         lambda env, o: _reason(env, o, **{"parallel.hsdp": True})),
    Case("checkpoint-under-quantization", ("quantization",),
         lambda env, o: _reason(env, o, quantization="fp8_per_tensor")),
    Case("checkpoint-under-pin-limit", ("offload.runtime_cache_pin_limit_gib",),
         lambda env, o: _reason(env, o, **{"offload.use_allgather": False,
                                           "offload.enable_runtime_cache": True,
                                           "offload.runtime_cache_pin_limit_gib": 1.0})),
    Case("runtime-cache-off", ("offload.enable_runtime_cache",), _cache_off),
    Case("registration-over-budget", ("offload.runtime_cache_pin_limit_gib",), _over_budget),
    Case("entry-file-never-came", ("loader.timeout_s",), _entry_wait),
)


@pytest.fixture(scope="module")
def env(flux: nn.Module, flux_layout: Path, tmp_path_factory: pytest.TempPathFactory) -> Env:
    return Env(flux, flux_layout, tmp_path_factory.mktemp("field-names"))


@pytest.mark.parametrize("origin", ORIGINS, ids=("document", "cr"))
@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_the_runtime_names_each_field_as_the_documents_origin_does(
        case: Case, origin: str | None, env: Env) -> None:
    check(case, env, origin)
