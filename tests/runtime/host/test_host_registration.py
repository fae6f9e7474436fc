"""Host registration lifecycle on the CPU, with a fake CUDA runtime at the very bottom."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import FluxTransformer2DModel
from support.fake_cudart import FakeCudart
from support.host_helpers import settings_with

from dlo_runtime.checkpoint_plan import build_meta_dit, preflight
from dlo_runtime.cuda_registration import (
    HOST_REGISTER_PORTABLE, HOST_REGISTER_READ_ONLY, CudaRegistrationBackend,
)
from dlo_runtime import host_registration
from dlo_runtime.host_registration import (
    PAGE, HostRange, RegistrationError, plan_ranges, register_plan,
)
from dlo_runtime.host_weight_plan import HostWeightPlan
from dlo_runtime.mapping import MappedEntry
from dlo_contract.validation import cr_names


class Handle:
    """Stands in for the entry's `.use` handle, to record when the mapping closes."""

    def __init__(self, calls: list[tuple]) -> None:
        self.calls = calls

    def close(self) -> None:
        self.calls.append(("close-mapping",))


@pytest.fixture
def fake() -> FakeCudart:
    return FakeCudart()


def mapped_plan(flux_layout: Path, fake: FakeCudart) -> HostWeightPlan:
    dit = build_meta_dit(FluxTransformer2DModel, flux_layout / "transformer", torch.float32)
    plan = preflight(flux_layout, dit, settings_with()).plan
    assert plan is not None
    # Preflight made its own mapping; rebuild it around a handle that records the close.
    return HostWeightPlan(backing_kind=plan.backing_kind, bindings=plan.bindings,
                          source=MappedEntry(flux_layout, handle=Handle(fake.calls)))


def backend(fake: FakeCudart) -> CudaRegistrationBackend:
    return CudaRegistrationBackend(0, cudart=fake)


def test_ranges_are_page_aligned_coalesced_per_file_and_split() -> None:
    spans = [("a", 10 * PAGE + 8, 100), ("a", 10 * PAGE + 200, 50), ("a", 11 * PAGE, 10),
             ("a", 20 * PAGE, PAGE), ("b", 10 * PAGE, 1), ("a", 30 * PAGE, 0)]
    assert plan_ranges(spans) == [
        HostRange("a", 10 * PAGE, 2 * PAGE), HostRange("a", 20 * PAGE, PAGE),
        HostRange("b", 10 * PAGE, PAGE)]
    assert plan_ranges([("a", 0, 5 * PAGE)], max_call_bytes=2 * PAGE) == [
        HostRange("a", 0, 2 * PAGE), HostRange("a", 2 * PAGE, 2 * PAGE),
        HostRange("a", 4 * PAGE, PAGE)]


def test_registers_every_file_read_only_then_unregisters_before_unmapping(
        flux_layout: Path, fake: FakeCudart) -> None:
    plan = mapped_plan(flux_layout, fake)
    outcome = register_plan(plan, budget_bytes=1 << 30, backend=backend(fake))
    registers = [c for c in fake.calls if c[0] == "register"]
    assert outcome.registered and outcome.calls == len(registers) == 3
    assert {c[3] for c in registers} == {HOST_REGISTER_READ_ONLY | HOST_REGISTER_PORTABLE}
    assert all(c[1] % PAGE == 0 and c[2] % PAGE == 0 for c in registers)
    assert plan.sources_pinned
    tensors = plan.take_tensors()
    assert all(fake.memory_type(t.data_ptr())[1] for t in tensors.values() if t.nbytes)
    plan.close()
    tail = fake.calls[-4:]
    assert tail == [("unregister", c[1]) for c in reversed(registers)] + [("close-mapping",)]
    assert fake.registered == {}


def test_over_budget_makes_no_platform_call_and_keeps_staging(
        flux_layout: Path, fake: FakeCudart) -> None:
    plan = mapped_plan(flux_layout, fake)
    outcome = register_plan(plan, budget_bytes=PAGE, backend=backend(fake),
                            names=cr_names)
    assert not outcome.registered
    assert outcome.reason == (
        f"registration needs {outcome.bytes} bytes, more than the budget of {PAGE} bytes "
        "(spec.offload.runtimeCachePinLimitGiB); raise spec.offload.runtimeCachePinLimitGiB to "
        "at least 1 to register it")
    assert fake.calls == []
    assert not plan.sources_pinned
    plan.close()


def test_unsupported_device_keeps_staging(flux_layout: Path) -> None:
    fake = FakeCudart(read_only_supported=False)
    plan = mapped_plan(flux_layout, fake)
    outcome = register_plan(plan, budget_bytes=1 << 30, backend=backend(fake))
    assert outcome.reason == "CUDA device 0 does not support read-only host registration"
    assert fake.platform_calls() == [] and not plan.sources_pinned
    plan.close()


def test_failure_on_range_k_unregisters_earlier_ranges_in_reverse(flux_layout: Path) -> None:
    fake = FakeCudart(fail_register_call=3)
    plan = mapped_plan(flux_layout, fake)
    outcome = register_plan(plan, budget_bytes=1 << 30, backend=backend(fake))
    first, second, third = [c for c in fake.calls if c[0] == "register"]
    assert fake.platform_calls() == [first, second, third,
                                     ("unregister", second[1]), ("unregister", first[1])]
    assert not outcome.registered and fake.registered == {}
    assert outcome.reason == (
        f"registering range 3 of 3 ({_file_of(plan, 2)}) "
        f"failed: cudaHostRegister({third[1]:#x}, {third[2]}) failed: out of memory")
    assert not plan.sources_pinned
    plan.close()


def _file_of(plan: HostWeightPlan, index: int) -> str:
    return sorted({b.file for b in plan.bindings})[index]


def test_views_not_reported_pinned_roll_everything_back(flux_layout: Path) -> None:
    fake = FakeCudart(pinned_answer=False)
    plan = mapped_plan(flux_layout, fake)
    outcome = register_plan(plan, budget_bytes=1 << 30, backend=backend(fake))
    assert not outcome.registered and fake.registered == {}
    assert outcome.reason.endswith(" mapped tensor(s) do not report pinned after registration, "
                                   f"first {plan.bindings[0].name!r}")
    plan.close()


def test_failed_rollback_is_a_startup_error(flux_layout: Path) -> None:
    fake = FakeCudart(fail_register_call=2, fail_unregister=True)
    plan = mapped_plan(flux_layout, fake)
    with pytest.raises(RegistrationError) as caught:
        register_plan(plan, budget_bytes=1 << 30, backend=backend(fake))
    first = fake.calls[1]
    assert str(caught.value) == (
        f"1 registered host range(s) could not be released, first {_file_of(plan, 0)} at "
        f"{first[1]:#x} ({first[2]} bytes): cudaHostUnregister({first[1]:#x}) failed: pointer "
        "does not correspond to a registered memory region")
    # The still-registered pages stay mapped until the process exits.
    assert any(first[1] <= view.data_ptr() < first[1] + first[2]
               for views in host_registration._NEVER_UNMAP for view in views.values())


def test_failed_unregister_at_shutdown_keeps_the_mapping(flux_layout: Path) -> None:
    fake = FakeCudart()
    plan = mapped_plan(flux_layout, fake)
    assert register_plan(plan, budget_bytes=1 << 30, backend=backend(fake)).registered
    fake.fail_unregister = True
    with pytest.raises(RegistrationError):
        plan.close()
    assert ("close-mapping",) not in fake.calls and plan.sources_pinned
