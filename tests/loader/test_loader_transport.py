"""The loader group's chunk all-gather over real gloo ranks: every peer's chunk lands in its slot
of the round's buffer, with several rounds in flight, and without torch's all-gather (whose flat
tensor was new memory every round, outside the loader's memory limit)."""

from __future__ import annotations

from typing import Any

import pytest
from support import chunk_gather_worker
from support.gloo_world import run_world

WORLD = 3


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_world(chunk_gather_worker.main, WORLD, tmp_path_factory.mktemp("chunk-gather"))


def test_every_rank_holds_every_peers_chunk_in_its_slot_of_every_round(
        ranks: list[dict[str, Any]]) -> None:
    expected = [[True] * WORLD for _ in range(chunk_gather_worker.ROUNDS)]
    assert [outcome["slots"] for outcome in ranks] == [expected] * WORLD
