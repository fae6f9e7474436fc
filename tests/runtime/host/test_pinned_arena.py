"""Host arenas page-locked at their exact size, down to the faked CUDA runtime call: registered
writable and portable at the requested bytes rounded up to one page (not a power of two),
reported pinned, filled and streamed bit for bit, and unregistered when the last view goes."""

from __future__ import annotations

import gc
import logging

import pytest
import torch
from support.fake_cudart import FakeCudart
from support.runtime_helpers import RANK_LOCAL, forward, mapped_plan, strip_parameters

from dlo_bench.models import example_inputs, tiny_model
from dlo_runtime.backend import DistributedLayerwiseOffloadBackend, host_bytes
from dlo_runtime.cuda_registration import HOST_REGISTER_PORTABLE, CudaRegistrationBackend
from dlo_runtime.host_registration import PAGE
from dlo_runtime.pinned_arena import PinnedHostMemory, PinnedMemoryError, page_round
from dlo_runtime.transfer import ShardStore, StagedSource


def pinned(fake: FakeCudart) -> PinnedHostMemory:
    return PinnedHostMemory(CudaRegistrationBackend(0, cudart=fake, read_only=False))


def test_an_arena_is_registered_writable_at_its_size_rounded_to_a_page() -> None:
    fake = FakeCudart()
    memory = pinned(fake)
    arena = memory.empty(5 * PAGE // 2 + 1, torch.bfloat16)  # 5 pages and 2 bytes
    address = arena.data_ptr()
    assert address % PAGE == 0
    assert fake.platform_calls() == [("register", address, 6 * PAGE, HOST_REGISTER_PORTABLE)]
    assert memory.pinned_bytes == 6 * PAGE  # the caching allocator would take 8 pages
    assert arena.untyped_storage().nbytes() == 5 * PAGE + 2
    arena.fill_(1.5)
    view = arena.narrow(0, 7, 3)
    del arena
    gc.collect()
    assert fake.registered == {address: 6 * PAGE}  # a view still holds the pages
    assert view.tolist() == [1.5, 1.5, 1.5]
    del view
    gc.collect()
    assert fake.registered == {}
    assert fake.platform_calls()[-1] == ("unregister", address)


def test_a_failed_registration_is_an_error_with_a_hint() -> None:
    fake = FakeCudart(fail_register_call=1)
    with pytest.raises(PinnedMemoryError) as caught:
        pinned(fake).empty(10, torch.float32)
    assert str(caught.value) == (
        f"page-locking a host arena of {PAGE} bytes failed: cudaHostRegister"
        f"({fake.calls[0][1]:#x}, {PAGE}) failed: out of memory")
    assert caught.value.hint == ("raise the pod's memory limit or the locked-memory limit "
                                 "(ulimit -l)")


def test_an_arena_that_does_not_report_pinned_is_released_and_refused() -> None:
    fake = FakeCudart(pinned_answer=False)
    with pytest.raises(PinnedMemoryError, match="does not report pinned after registration"):
        pinned(fake).empty(10, torch.float32)
    gc.collect()
    assert fake.registered == {}


def test_pages_that_cannot_be_unregistered_stay_mapped(caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeCudart()
    arena = pinned(fake).empty(4, torch.float32)
    fake.fail_unregister = True
    with caplog.at_level(logging.ERROR, logger="dlo_runtime.pinned_arena"):
        del arena
        gc.collect()
    assert "could not be unregistered, keeping it mapped" in caplog.text


@pytest.mark.parametrize("backing", ["ordinary", "mapped"])
def test_the_backend_streams_from_exactly_pinned_arenas(backing: str) -> None:
    fake = FakeCudart()
    reference = tiny_model("flux", num_layers=4)
    inputs = example_inputs("flux", reference)
    expected = forward(reference, inputs)
    model = tiny_model("flux", num_layers=4)
    plan = None
    if backing == "mapped":
        plan, _ = mapped_plan(model)
        strip_parameters(model)
    backend = DistributedLayerwiseOffloadBackend(
        model, settings=RANK_LOCAL, device="cpu", host_plan=plan, host_memory=pinned(fake))
    with backend:
        source = backend._source
        assert isinstance(source, ShardStore if backing == "ordinary" else StagedSource)
        arenas = source.arena
        assert sorted(fake.registered.values()) == sorted(
            page_round(a.untyped_storage().nbytes()) for a in arenas)
        assert sum(fake.registered.values()) - host_bytes(arenas) < PAGE * len(arenas)
        assert sorted(fake.registered) == sorted(a.data_ptr() for a in arenas)
        for _ in range(2):
            assert torch.equal(forward(model, inputs), expected)
        del source, arenas
    gc.collect()
    assert fake.registered == {}
    assert torch.equal(forward(model, inputs), expected)
