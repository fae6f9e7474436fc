"""Calls of one offloaded DiT: a forward from another thread waits for the one in flight, and
both equal the resident model; a forward from inside the DiT's own forward, and one that would
need a backward, are refused."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from support.runtime_helpers import RANK_LOCAL, forward

from dlo_bench.models import example_inputs, tiny_model
from dlo_runtime.backend import DistributedLayerwiseOffloadBackend
from dlo_runtime.tensors import OffloadError


class AnnouncingLock:
    """Stands for the gate's lock and tells the test which threads came to take it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.arrived: dict[str, threading.Event] = {"B": threading.Event()}

    def acquire(self) -> bool:
        self.arrived.setdefault(threading.current_thread().name, threading.Event()).set()
        return self.lock.acquire()

    def release(self) -> None:
        self.lock.release()


def test_a_forward_from_another_thread_waits_for_the_one_in_flight_and_both_are_exact() -> None:
    """Thread A is inside block 1 (its weights pointed into a slot) when thread B calls the DiT;
    B waits at the gate until A's forward has returned. The events force that interleaving."""
    reference = tiny_model("wan")
    inputs = example_inputs("wan", reference)
    expected = forward(reference, inputs)
    model = tiny_model("wan")
    outputs: dict[str, Any] = {}

    def request(name: str) -> None:
        try:
            outputs[name] = forward(model, inputs)
        except Exception as exc:  # noqa: BLE001 - asserted below
            outputs[name] = exc

    b = threading.Thread(target=request, args=("B",), name="B")

    def b_arrives_while_a_is_inside_block_1(*_: Any) -> None:
        if threading.current_thread().name == "A":
            b.start()
            assert lock.arrived["B"].wait(timeout=60), "B never reached the gate"

    with DistributedLayerwiseOffloadBackend(model, settings=RANK_LOCAL, device="cpu") as backend:
        backend._forward_gate._lock = lock = AnnouncingLock()
        model.blocks[1].register_forward_pre_hook(b_arrives_while_a_is_inside_block_1)
        a = threading.Thread(target=request, args=("A",), name="A")
        a.start()
        a.join()
        b.join()
        assert backend.stats().total.forwards == 2
    assert not isinstance(outputs["A"], Exception), outputs["A"]
    assert not isinstance(outputs["B"], Exception), outputs["B"]
    assert torch.equal(outputs["A"], expected) and torch.equal(outputs["B"], expected)


NESTED = ("WanTransformer3DModel was called from inside its own forward; DLO streams one forward "
          "of a DiT at a time, and the nested one would take the device slots of the blocks the "
          "outer one is running")


def test_a_forward_from_inside_the_dits_own_forward_is_refused_and_the_outer_one_stays_exact(
) -> None:
    reference = tiny_model("wan")
    inputs = example_inputs("wan", reference)
    expected = forward(reference, inputs)
    model = tiny_model("wan")
    refused: list[OffloadError] = []
    nested: list[bool] = []

    def call_again_and_catch(*_: Any) -> None:
        if not nested:  # once: the nested call runs block 1 too
            nested.append(True)
            with pytest.raises(OffloadError) as caught:
                model(**inputs)
            refused.append(caught.value)

    def call_again(*_: Any) -> None:
        if len(nested) < 2:
            nested.append(True)
            model(**inputs)

    with DistributedLayerwiseOffloadBackend(model, settings=RANK_LOCAL, device="cpu"):
        hook = model.blocks[1].register_forward_pre_hook(call_again_and_catch)
        assert torch.equal(forward(model, inputs), expected)
        assert [str(e) for e in refused] == [NESTED]
        assert refused[0].hint == ("call the DiT again after its forward has returned (forwards "
                                   "from other threads wait for it; the same thread's cannot)")
        hook.remove()
        hook = model.blocks[1].register_forward_pre_hook(call_again)
        with pytest.raises(OffloadError) as caught:
            forward(model, inputs)
        assert str(caught.value) == NESTED
        hook.remove()
        assert torch.equal(forward(model, inputs), expected)


def test_a_forward_that_would_need_a_backward_is_refused_and_grad_mode_alone_is_not() -> None:
    """Gradient-based guidance takes d(output)/d(latents): refused before any block runs, naming
    the input. Grad mode with no input requiring grad (as diffusers may call the DiT) runs."""
    reference = tiny_model("wan")
    inputs = example_inputs("wan", reference)
    expected = forward(reference, inputs)
    model = tiny_model("wan")
    latents = inputs["hidden_states"].clone().requires_grad_(True)
    with DistributedLayerwiseOffloadBackend(model, settings=RANK_LOCAL, device="cpu") as backend:
        assert torch.is_grad_enabled()
        assert torch.equal(model(**inputs)[0].detach(), expected)
        with pytest.raises(OffloadError) as caught:
            model(**inputs | {"hidden_states": latents})
        assert str(caught.value) == (
            "WanTransformer3DModel was called with grad enabled and its input hidden_states "
            "requires grad; DLO streams weights for inference only (after each block they are "
            "empty placeholders), so no backward through the DiT can run")
        assert caught.value.hint == ("run the forward under torch.no_grad() or "
                                     "torch.inference_mode(), or pass detached inputs")
        with pytest.raises(OffloadError, match="its input argument 0 requires grad"):
            model(latents, **{k: v for k, v in inputs.items() if k != "hidden_states"})
        assert torch.equal(forward(model, inputs | {"hidden_states": latents}), expected)
        assert backend.stats().total.forwards == 2
