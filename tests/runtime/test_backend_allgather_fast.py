"""AllGather mode over two real gloo processes on the asynchronous stream model, in the fast
suite: rank 1 rebuilds every block from its own shard at a non-zero offset, so a wrong shard
offset, a gather that does not wait for the shard's copy (`staged`), or a copy into a slot that
a gather still writes (`ready`) fails here, not only in the slow suite."""

from __future__ import annotations

from typing import Any

import pytest
from support import stream_dist_worker
from support.gloo_world import run_world

WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out_dir = tmp_path_factory.mktemp("allgather")
    return run_world(stream_dist_worker.main, WORLD, out_dir)


def test_every_rank_gathers_the_exact_blocks(ranks: list[dict[str, Any]]) -> None:
    for outcomes in ranks:
        outcome = outcomes["flux-dp-lazy"]
        assert (outcome["mode"], outcome["shard_count"]) == ("allgather", WORLD)
        assert (outcome["equal"], outcome["equal_second_step"], outcome["equal_after_disable"]) == (
            True, True, True,
        )
        share = outcome["streamed_bytes"] / WORLD
        assert share <= outcome["host_bytes"] <= share * 1.02


def test_a_skipped_block_is_replaced_exactly_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    assert [outcomes["sd3-skip-dp-lazy"] for outcomes in ranks] == [
        {"equal_skip": True, "equal": True}
    ] * WORLD
