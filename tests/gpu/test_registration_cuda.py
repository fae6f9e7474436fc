"""Real read-only registration of a runtime-cache entry with the CUDA runtime."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from dlo_bench.models import example_inputs, tiny_model
from dlo_runtime import pod
from dlo_runtime.cuda_registration import Cudart, CudaRegistrationBackend, MEMORY_TYPE_HOST
from dlo_runtime.host_registration import register_plan
from dlo_runtime.runtime_weight_cache import RuntimeLayout, load_runtime_plan
from dlo_contract.settings import Settings, replace_path

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def cache_settings(root: Path, pin_limit_gib: float) -> Settings:
    settings = Settings()
    for dotted, value in (("offload.use_allgather", False), ("offload.enable_runtime_cache", True),
                          ("offload.runtime_cache_pin_limit_gib", pin_limit_gib),
                          ("cache.root", str(root))):
        settings = replace_path(settings, dotted, value)
    return settings


@pytest.fixture
def backend() -> CudaRegistrationBackend:
    backend = CudaRegistrationBackend(torch.cuda.current_device())
    reason = backend.unsupported_reason()
    if reason is not None:
        pytest.skip(reason)
    return backend


def test_entry_registers_copies_directly_and_unregisters(tmp_path: Path,
                                                         backend: CudaRegistrationBackend) -> None:
    model = tiny_model("flux")
    result = load_runtime_plan(model, cache_settings(tmp_path, 1.0), RuntimeLayout())
    plan = result.plan
    assert plan is not None, result.reason
    outcome = register_plan(plan, budget_bytes=1 << 30, backend=backend)
    assert outcome.registered, outcome.reason
    views = plan.take_tensors()
    assert all(view.is_pinned() for view in views.values() if view.nbytes)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        copies = {name: view.to("cuda", non_blocking=True) for name, view in views.items()}
    stream.synchronize()
    state = model.state_dict()
    assert all(torch.equal(copies[name].cpu(), state[name]) for name in state)
    plan.close()
    cudart = Cudart()
    assert not any(cudart.memory_type(view.data_ptr())[1] == MEMORY_TYPE_HOST
                   for view in views.values() if view.nbytes)


def test_pod_streams_from_registered_pages_and_unregisters_at_close(
        tmp_path: Path, backend: CudaRegistrationBackend,
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"register": 0, "unregister": 0}
    for verb in calls:
        original = getattr(CudaRegistrationBackend, verb)

        def counted(self, *args, _verb=verb, _original=original):
            calls[_verb] += 1
            return _original(self, *args)

        monkeypatch.setattr(CudaRegistrationBackend, verb, counted)
    resident = tiny_model("flux").cuda()
    inputs = example_inputs("flux", resident)
    dit = copy.deepcopy(resident).cpu()
    handle = pod.enable(dit, device="cuda", settings=cache_settings(tmp_path, 1.0),
                        entry_file=str(tmp_path / "no-entry.json"))
    try:
        assert handle.backing().value == "runtime_cache"
        assert calls["register"] > 0 and calls["unregister"] == 0
        with torch.no_grad():
            assert torch.equal(dit(**inputs)[0], resident(**inputs)[0])
    finally:
        handle.close()
    assert calls["unregister"] == calls["register"]
