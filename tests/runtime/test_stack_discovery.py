"""Diffusers DiTs with two or more block stacks and no built-in plan: every stack streams, in the
order the first forward runs the blocks, and the output equals the resident one bit for bit.

The order check compares what the backend learned with the order hooks on an un-offloaded copy
observe, and the statistics show that once learned, every forward loads each block exactly once
(no block was prefetched out of turn)."""

from __future__ import annotations

import logging

import pytest
import torch
from support.runtime_helpers import RANK_LOCAL, forward
from support.stack_models import STACK_MODELS, run_order, stack_inputs, stack_model

from dlo_bench.models import KINDS, example_inputs, tiny_model
from dlo_runtime.backend import DistributedLayerwiseOffloadBackend
from dlo_runtime.execution_order import OrderState
from dlo_runtime.offload_plan import block_lists, weight_bytes


@pytest.mark.parametrize("name", sorted(STACK_MODELS))
def test_every_stack_streams_in_run_order_bit_for_bit(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    reference = stack_model(name)
    inputs = stack_inputs(name, reference)
    expected = forward(reference, inputs)
    model = stack_model(name)
    largest = max(size for _, size in block_lists(model)) / weight_bytes(model)
    backend = DistributedLayerwiseOffloadBackend(model, settings=RANK_LOCAL, device="cpu")
    with caplog.at_level(logging.INFO, logger="dlo_runtime.backend"), backend:
        paths = [layout.path for layout in backend.layouts]
        assert len({path.rsplit(".", 1)[0] for path in paths}) >= 2
        assert backend.streamed_share > largest  # more than the largest stack alone
        assert backend._order is not None and backend._order.state is OrderState.LEARNING
        for _ in range(3):
            assert torch.equal(forward(model, inputs), expected)
        assert backend._order.state is OrderState.FIXED
        assert backend._order.run_order() == run_order(reference, inputs, paths)
        stats = backend.stats()
        assert stats.last_forward.blocks_loaded == len(paths)
        assert stats.total.forwards == 3
    assert f"streamed share {100 * backend.streamed_share:.1f}%" in caplog.text
    assert "learned the run order" in caplog.text
    assert torch.equal(forward(model, inputs), expected)


@pytest.mark.parametrize("kind", KINDS)
def test_builtin_plans_keep_their_order_and_report_their_share(kind: str) -> None:
    reference = tiny_model(kind)
    inputs = example_inputs(kind, reference)
    expected = forward(reference, inputs)
    model = tiny_model(kind)
    with DistributedLayerwiseOffloadBackend(model, settings=RANK_LOCAL, device="cpu") as backend:
        assert backend._order is not None and backend._order.state is OrderState.FIXED
        paths = [layout.path for layout in backend.layouts]
        assert backend._order.run_order() == paths == run_order(reference, inputs, paths)
        for _ in range(2):
            assert torch.equal(forward(model, inputs), expected)
        assert backend.stats().last_forward.blocks_loaded == len(paths)
        assert 0 < backend.streamed_share < 1
        assert backend.streamed_share == backend.streamed_bytes / weight_bytes(reference)
