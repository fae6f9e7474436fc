"""Eviction before a fill, with real processes on a small tmpfs: the loader removes the least
recently used entry nobody maps until the incoming entry fits `cache.max_bytes`, never touches an
entry in use, and, when even that is not enough, fails naming the entries in use."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from dlo_bench.s3server import DUMMY_CREDENTIALS, S3Server
from safetensors.numpy import save_file
from support.cache_fixtures import tmpfs, workers  # noqa: F401  (pytest fixtures)
from support.cache_helpers import Workers, publish_files
from support.loader_fleet import LOADER_SETTINGS, finish, upload_files
from dlo_contract.cache import CacheRoot, list_entries

HELD_BYTES = 200_000
OLD_BYTES = 200_000


def _checkpoint(tmp: Path, s3: S3Server, prefix: str, seed: int) -> tuple[str, int]:
    local = tmp / prefix
    local.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    save_file({"w": rng.standard_normal(36_000, dtype=np.float32)}, str(local / "m.safetensors"))
    files = {"m.safetensors": (local / "m.safetensors").read_bytes()}
    return upload_files(s3, prefix, files, tmp / f"up-{prefix}"), len(files["m.safetensors"])


def _fill(tmp: Path, s3: S3Server, root: Path, source: str, max_bytes: int,
          name: str) -> dict:
    config = tmp / f"{name}.json"
    config.write_text(json.dumps({"loader": LOADER_SETTINGS | {"source": source},
                                  "cache": {"root": str(root), "max_bytes": max_bytes}}))
    process = subprocess.Popen(
        [sys.executable, "-m", "dlo_cli.main", "cache", "fill", "--config", str(config),
         "--endpoint-url", s3.endpoint_url, "--entry-file", str(tmp / f"{name}-entry.json"),
         "--summary-file", str(tmp / f"{name}-summary")],
        env={**DUMMY_CREDENTIALS, "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
        text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    outcome = finish(0, process)
    assert outcome.summary, (outcome.stdout, outcome.stderr)
    return outcome.summary


@pytest.mark.usefixtures("aws_env")
def test_fill_evicts_the_unused_entry_and_keeps_the_one_in_use(
        s3: S3Server, tmpfs: Path, tmp_path: Path, workers: Workers) -> None:
    root = CacheRoot(tmpfs / "cache")
    holder_publish = workers.start("publish", str(root.path), "held", "--size", str(HELD_BYTES))
    held = Path(Workers.result(holder_publish)["path"]).name
    old = publish_files(root, "s3://models/old/", {"w.bin": b"o" * OLD_BYTES})
    holder = workers.start("hold-use", str(root.path), "held", "--marker",
                           str(tmp_path / "holding"))
    workers.wait_for(tmp_path / "holding", holder)
    source, size = _checkpoint(tmp_path, s3, "evict-new", seed=1)
    # Fits next to the entry in use, but not next to both: the old one must go first.
    max_bytes = HELD_BYTES + size + 1000
    assert OLD_BYTES + HELD_BYTES + size > max_bytes

    summary = _fill(tmp_path, s3, root.path, source, max_bytes, "first")

    assert summary["status"] == "ok", summary
    assert summary["bytes_from_store"] == size
    left = {info.entry_id: info for info in list_entries(root)}
    assert set(left) == {held, summary["entry_id"]}
    assert old not in left and left[held].in_use
    assert sum(info.bytes for info in left.values()) <= max_bytes

    # A second model that fits only if the entry in use went too: refused, naming it.
    other, other_size = _checkpoint(tmp_path, s3, "evict-other", seed=2)
    too_small = HELD_BYTES + other_size - 1
    failed = _fill(tmp_path, s3, root.path, other, too_small, "second")

    assert failed["status"] == "error"
    assert failed["error"].startswith("no room for cache entry ")
    assert (f"{other_size} bytes) in {root.path}: {HELD_BYTES} bytes in entries "
            f"(cache.max_bytes={too_small})") in failed["error"]
    assert failed["error"].endswith(
        f"after evicting 1 unused entries; in use: {held} ({HELD_BYTES} bytes) (hint: stop the "
        "pods that map the entries in use, raise cache.maxBytes, or enlarge the volume)")
    assert [info.entry_id for info in list_entries(root)] == [held]
    assert Workers.result(holder) == {"held": True}
