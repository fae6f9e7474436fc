"""AllGather mode from a checkpoint plan: two real gloo processes shard the mapped checkpoint,
release the mapping, each computes exactly the resident output, and a call of the DiT after the
handle is closed raises dlo's error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import support
from dlo_bench.s3server import free_port
from support.host_helpers import publish_checkpoint, settings_with, write_entry_file

WORKER = Path(support.__file__).with_name("pod_allgather_worker.py")
WORLD = 2
CLOSED = ("OffloadError: FluxTransformer2DModel was disabled with restore=False, so its streamed "
          "tensors are empty placeholders")
"""A call of the DiT once its handle is closed: dlo's error, not torch's shape error."""


@pytest.mark.slow
def test_allgather_forward_from_checkpoint_plan_is_exact(tmp_path: Path,
                                                         flux_layout: Path) -> None:
    root = tmp_path / "cache"
    entry_file = write_entry_file(tmp_path, publish_checkpoint(root, flux_layout))
    document = tmp_path / "settings.json"
    document.write_text(settings_with(**{"parallel.dp": WORLD, "cache.root": str(root)}).to_json())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "DLO_CONFIG": str(document),
           "DLO_ENTRY_FILE": str(entry_file), "OMP_NUM_THREADS": "1"}
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(rank), str(WORLD), str(port)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(WORLD)]
    reports = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        reports.append(json.loads(out.strip().splitlines()[-1]))
    assert reports == [{"rank": rank, "weightless": True, "backing": "checkpoint", "equal": True,
                        "mapped_after_enable": False, "after_close": CLOSED}
                       for rank in range(WORLD)]
