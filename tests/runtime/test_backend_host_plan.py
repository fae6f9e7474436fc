"""The backend consumes a host weight plan exactly once (contract C4): mapped sources stream through
the two staging slots (one host arena) in rank-local mode and are released at disable; ordinary
tensors are packed once; a plan that does not cover the DiT is refused before the model changes."""

from __future__ import annotations

import pytest
import torch
from support.runtime_helpers import RANK_LOCAL, forward, mapped_plan, run_case, strip_parameters

from dlo_bench.models import example_inputs, tiny_model
from dlo_runtime.backend import DistributedLayerwiseOffloadBackend, host_bytes
from dlo_runtime.host_weight_plan import HostPlanError, HostWeightPlan, runtime_tensors
from dlo_runtime.tensors import OffloadError
from dlo_runtime.transfer import MappedSource


def test_mapped_plan_is_used_in_place_on_the_cpu_and_released_at_disable() -> None:
    reference = tiny_model("flux")
    inputs = example_inputs("flux", reference)
    expected = forward(reference, inputs)
    plan, mapping = mapped_plan(reference)
    model = tiny_model("flux", seed=7)
    strip_parameters(model)
    backend = DistributedLayerwiseOffloadBackend(
        model, settings=RANK_LOCAL, device="cpu", host_plan=plan
    )
    with backend:
        assert plan.taken
        assert torch.equal(forward(model, inputs), expected)
        assert torch.equal(forward(model, inputs), expected)
        assert not mapping.closed
        # No staging and no slot memory: the mapped views are the blocks' weights.
        assert isinstance(backend._source, MappedSource)
        assert host_bytes(backend.host_tensors()) == backend.streamed_bytes
        assert backend.slot_bytes == 0
    assert mapping.closed
    with pytest.raises(HostPlanError, match="sources were released"):
        plan.source_views()
    assert torch.equal(forward(model, inputs), expected)


def test_ordinary_plan_is_packed_once_and_the_module_weights_are_ignored() -> None:
    reference = tiny_model("wan", seed=5)
    plan = HostWeightPlan.ordinary(runtime_tensors(reference))
    outcome = run_case("wan", RANK_LOCAL, host_plan=plan, seed=5)
    assert (outcome.equal, outcome.equal_second_step, outcome.equal_after_disable) == (
        True, True, True,
    )
    assert plan.taken


def test_a_plan_has_one_consumer_and_re_enabling_uses_the_restored_tensors() -> None:
    reference = tiny_model("wan", seed=5)
    inputs = example_inputs("wan", reference)
    expected = forward(reference, inputs)
    plan = HostWeightPlan.ordinary(runtime_tensors(reference))
    model = tiny_model("wan")
    backend = DistributedLayerwiseOffloadBackend(
        model, settings=RANK_LOCAL, device="cpu", host_plan=plan
    )
    backend.enable()
    backend.disable()
    with backend:
        assert torch.equal(forward(model, inputs), expected)
    second = DistributedLayerwiseOffloadBackend(
        tiny_model("wan"), settings=RANK_LOCAL, device="cpu", host_plan=plan
    )
    with pytest.raises(HostPlanError) as caught:
        second.enable()
    assert str(caught.value) == (
        "take_tensors() was already called on this ordinary plan; a plan has exactly one consumer"
    )


def test_plan_that_misses_a_tensor_is_refused_before_the_model_changes() -> None:
    model = tiny_model("wan")
    tensors = runtime_tensors(tiny_model("wan"))
    del tensors["blocks.1.ffn.net.2.weight"]
    tensors["blocks.9.extra"] = torch.zeros(1)
    before = [p.data_ptr() for p in model.parameters()]
    backend = DistributedLayerwiseOffloadBackend(
        model, settings=RANK_LOCAL, device="cpu", host_plan=HostWeightPlan.ordinary(tensors)
    )
    with pytest.raises(OffloadError) as caught:
        backend.enable()
    assert str(caught.value) == (
        "the host weight plan does not match the DiT: missing blocks.1.ffn.net.2.weight; "
        "unexpected blocks.9.extra"
    )
    assert [p.data_ptr() for p in model.parameters()] == before
    assert not backend.enabled
