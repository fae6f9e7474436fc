"""Compiled DLO in AllGather mode over 2 gloo ranks: regional and whole-model compilation give
outputs equal bit for bit to the compiled resident model on every rank, and after the warm-up
forward further forwards compile nothing (see `compiled_dist_worker.py`)."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp
from support import compiled_dist_worker

# Two ranks compile at once on a small machine: the warm-up dominates, and inductor caches on
# disk make later runs faster.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

WORLD = 2


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out_dir = tmp_path_factory.mktemp("compiled")
    mp.spawn(compiled_dist_worker.main, args=(WORLD, _free_port(), str(out_dir)), nprocs=WORLD)
    return [json.loads(Path(out_dir, f"rank{rank}.json").read_text()) for rank in range(WORLD)]


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
