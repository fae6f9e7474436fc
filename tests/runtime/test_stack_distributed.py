"""AllGather mode over two gloo processes on the two-stack DiTs and the three with built-in
plans: outputs equal the resident ones bit for bit, every rank learns the same run order, and a
forward that runs the blocks in a different order per rank is refused by name instead of
hanging in a collective later."""

from __future__ import annotations

from typing import Any

import pytest
from support import stack_dist_worker
from support.gloo_world import run_world
from support.stack_models import STACK_MODELS

from dlo_bench.models import KINDS

pytestmark = pytest.mark.slow
WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out_dir = tmp_path_factory.mktemp("stacks")
    return run_world(stack_dist_worker.main, WORLD, out_dir)


@pytest.mark.parametrize("name", [*sorted(STACK_MODELS), *KINDS])
def test_allgather_streams_every_stack_bit_for_bit_in_one_order(
    ranks: list[dict[str, Any]], name: str
) -> None:
    outcomes = [outcomes[name] for outcomes in ranks]
    for outcome in outcomes:
        assert outcome["mode"] == "allgather"
        assert outcome["equal"] == [True, True, True]
        assert outcome["equal_after_disable"]
        last = outcome["stats"]["last_forward"]
        assert last["blocks_loaded"] == outcome["blocks"]
        assert last["bytes_gathered"] == last["bytes_h2d"] * (WORLD - 1)
    assert outcomes[0]["order"] == outcomes[1]["order"]
    if name in STACK_MODELS:
        assert len({path.rsplit(".", 1)[0] for path in outcomes[0]["order"]}) >= 2


def test_ranks_running_blocks_in_different_orders_are_refused(
    ranks: list[dict[str, Any]],
) -> None:
    assert [outcomes["order-mismatch"] for outcomes in ranks] == [
        "rank 1 of the DLO group runs second.0 where this rank runs first.0 (block 1 of the "
        "first forward); AllGather loads would go out of step",
        "rank 0 of the DLO group runs first.0 where this rank runs second.0 (block 1 of the "
        "first forward); AllGather loads would go out of step",
    ]
