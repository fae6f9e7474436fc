"""Compiled DLO in AllGather mode over 2 gloo ranks: regional and whole-model compilation give
outputs equal bit for bit to the compiled resident model on every rank, and after the warm-up
forward further forwards compile nothing (see `compiled_dist_worker.py`)."""

from __future__ import annotations

from typing import Any

import pytest
from support import compiled_dist_worker
from support.gloo_world import run_world

# Two ranks compile at once on a small machine: the warm-up dominates, and inductor caches on
# disk make later runs faster.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out_dir = tmp_path_factory.mktemp("compiled")
    return run_world(compiled_dist_worker.main, WORLD, out_dir)


@pytest.mark.parametrize("case", sorted(compiled_dist_worker.CASES))
def test_compiled_allgather_is_exact_without_recompiles(
    ranks: list[dict[str, Any]], case: str
) -> None:
    for outcomes in ranks:
        outcome = outcomes[case]
        assert outcome["mode"] == "allgather"
        assert (outcome["equal_warmup"], outcome["equal_steady"]) == (True, True)
        assert outcome["equal_after_disable"]
        assert outcome["warmup_graphs"] > 0
        assert outcome["steady_graphs"] == 0
