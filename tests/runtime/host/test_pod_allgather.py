"""AllGather mode from a checkpoint plan: two real gloo processes shard the mapped checkpoint,
release the mapping, each computes exactly the resident output, and a call of the DiT after the
handle is closed raises dlo's error."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import pod_allgather_worker
from support.gloo_world import run_world
from support.host_helpers import publish_checkpoint, settings_with, write_entry_file

WORLD = 2
CLOSED = ("OffloadError: FluxTransformer2DModel was disabled with restore=False, so its streamed "
          "tensors are empty placeholders")
"""A call of the DiT once its handle is closed: dlo's error, not torch's shape error."""


@pytest.mark.slow
def test_allgather_forward_from_checkpoint_plan_is_exact(tmp_path: Path,
                                                         flux_layout: Path) -> None:
    root = tmp_path / "cache"
    entry_file = write_entry_file(tmp_path, publish_checkpoint(root, flux_layout))
    assert entry_file == tmp_path / pod_allgather_worker.ENTRY
    document = tmp_path / pod_allgather_worker.SETTINGS
    document.write_text(settings_with(**{"parallel.dp": WORLD, "cache.root": str(root)}).to_json())
    reports = run_world(pod_allgather_worker.main, WORLD, tmp_path)
    assert reports == [{"rank": rank, "weightless": True, "backing": "checkpoint", "equal": True,
                        "mapped_after_enable": False, "after_close": CLOSED}
                       for rank in range(WORLD)]
