"""Eviction before a fill, with real processes on a small tmpfs: the loader removes the least
recently used entry nobody maps until the incoming entry fits `cache.max_bytes`, never touches an
entry in use, and, when even that is not enough, fails naming the entries in use. A pod's loader
holds its entry in use for the pod's life and records each use; a loader that waits for another
one publishing the same entry joins it without evicting anything."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from dlo_bench.faultproxy import FaultPlan, FaultProxy
from dlo_bench.s3server import S3Server
from safetensors.numpy import save_file
from support.cache_fixtures import tmpfs, workers  # noqa: F401  (pytest fixtures)
from support.cache_helpers import Workers, publish_files
from support.loader_fleet import (
    LOADER_SETTINGS,
    OpenWatch,
    checkout_env,
    finish,
    upload_files,
    wait_until,
)
from dlo_loader.fill import FillRequest, FillResult, fill
from dlo_contract.cache import (
    CacheRoot,
    CacheSpaceError,
    FileRecord,
    begin_publication,
    list_entries,
    read_manifest,
    remove_entry,
)
from dlo_contract.settings import CacheConfig, LoaderConfig, Settings

HELD_BYTES = 200_000
OLD_BYTES = 200_000


def _checkpoint(tmp: Path, s3: S3Server, prefix: str, seed: int) -> tuple[str, int]:
    local = tmp / prefix
    local.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    save_file({"w": rng.standard_normal(36_000, dtype=np.float32)}, str(local / "m.safetensors"))
    files = {"m.safetensors": (local / "m.safetensors").read_bytes()}
    return upload_files(s3, prefix, files, tmp / f"up-{prefix}"), len(files["m.safetensors"])


def _start(tmp: Path, endpoint: str, root: Path, source: str, max_bytes: int, name: str,
           *extra: str) -> subprocess.Popen[str]:
    """`dlo cache fill` as the pod runs it (`extra`: e.g. `--keep-running`), with this
    checkout's code."""
    config = tmp / f"{name}.json"
    config.write_text(json.dumps({"loader": LOADER_SETTINGS | {"source": source},
                                  "cache": {"root": str(root), "max_bytes": max_bytes}}))
    return subprocess.Popen(
        [sys.executable, "-m", "dlo_cli.main", "cache", "fill", "--config", str(config),
         "--endpoint-url", endpoint, "--entry-file", str(tmp / f"{name}-entry.json"),
         "--summary-file", str(tmp / f"{name}-summary"), *extra],
        env=checkout_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _fill(tmp: Path, s3: S3Server, root: Path, source: str, max_bytes: int,
          name: str) -> dict:
    outcome = finish(0, _start(tmp, s3.endpoint_url, root, source, max_bytes, name))
    assert outcome.summary, (outcome.stdout, outcome.stderr)
    return outcome.summary


def _fill_here(s3: S3Server, root: Path, source: str, max_bytes: int) -> FillResult:
    """The same fill in this process (no entry held after it)."""
    loader = LoaderConfig(**LOADER_SETTINGS | {"source": source, "endpoint_url": s3.endpoint_url})
    return fill(FillRequest(settings=Settings(
        loader=loader, cache=CacheConfig(root=str(root), max_bytes=max_bytes))))


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
    assert (f"{other_size} bytes) in {root.path}: {HELD_BYTES} bytes in entries and 0 bytes "
            f"reserved by fills in progress (cache.max_bytes={too_small})") in failed["error"]
    assert failed["error"].endswith(
        f"after evicting 1 unused entries; in use: {held} ({HELD_BYTES} bytes); fills in "
        "progress: none (hint: stop the pods that map the entries in use or raise "
        "cache.max_bytes)")
    assert [info.entry_id for info in list_entries(root)] == [held]
    assert Workers.result(holder) == {"held": True}


@pytest.mark.usefixtures("aws_env")
def test_a_pods_loader_holds_its_entry_until_the_pod_ends(
        s3: S3Server, tmp_path: Path) -> None:
    """The server maps the entry minutes after its loader wrote the entry document (imports,
    pipeline construction): a fill of another model on the node in between must not evict it.
    The sidecar holds it in use until SIGTERM; after that it may go."""
    root = tmp_path / "cache"
    mine, mine_size = _checkpoint(tmp_path, s3, "held-by-pod", seed=3)
    other, other_size = _checkpoint(tmp_path, s3, "other-model", seed=4)
    room_for_one = max(mine_size, other_size) + 1000
    sidecar = _start(tmp_path, s3.endpoint_url, root, mine, room_for_one, "pod",
                     "--keep-running")
    entry_file = tmp_path / "pod-entry.json"
    try:
        deadline = time.monotonic() + 120
        while not entry_file.exists() and sidecar.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert entry_file.exists(), sidecar.communicate(timeout=10)
        held = json.loads(entry_file.read_text())["entry_id"]
        assert [(i.entry_id, i.in_use) for i in list_entries(root)] == [(held, True)]

        with pytest.raises(CacheSpaceError, match=f"in use: {held} "):
            _fill_here(s3, root, other, room_for_one)
        assert [i.entry_id for i in list_entries(root)] == [held]
    finally:
        sidecar.send_signal(signal.SIGTERM)
        _, err = sidecar.communicate(timeout=30)
    assert sidecar.returncode == 0, err
    assert not _fill_here(s3, root, other, room_for_one).cached  # the pod is gone: it may go
    assert [i.entry_id for i in list_entries(root)] != [held]


@pytest.mark.usefixtures("aws_env")
def test_a_fill_that_finds_its_entry_cached_records_its_use(
        s3: S3Server, tmp_path: Path) -> None:
    """Eviction goes least recently used first: a model pods keep starting on must count as
    used (the server's own mount may be read-only, so its loader records it)."""
    root = CacheRoot(tmp_path / "cache")
    hot_source, _ = _checkpoint(tmp_path, s3, "lru-hot", seed=5)
    hot = _fill_here(s3, root.path, hot_source, 0).entry_id
    cold = publish_files(root, "s3://models/cold/", {"w.bin": b"c" * 1000})
    published = {info.entry_id: info.last_used for info in list_entries(root)}
    assert published[hot] <= published[cold]
    time.sleep(0.05)  # past the filesystem's timestamp granularity

    summary = _fill(tmp_path, s3, root.path, hot_source, 0, "restart")

    assert summary["cached"] is True
    used = {info.entry_id: info.last_used for info in list_entries(root)}
    assert used[hot] > used[cold] and used[cold] == published[cold]
    assert [info.entry_id for info in list_entries(root)] == [cold, hot]  # evicted first: cold


@pytest.mark.usefixtures("aws_env")
def test_a_loader_waiting_for_the_same_entry_joins_it_without_making_room(
        s3: S3Server, tmpfs: Path, tmp_path: Path) -> None:
    """Pods of one model start together on a node: one loader publishes, the others wait for it
    and join. Making room before waiting counted the entry twice (once as the first loader's
    preallocated files): on a disk that holds one copy and a half, the second loader evicted
    every unused entry and failed for room instead of joining."""
    root = CacheRoot(tmpfs / "cache")
    source, size = _checkpoint(tmp_path, s3, "same-entry", seed=6)
    first = _fill_here(s3, root.path, source, 0)  # learns the entry; then it goes again
    data = (Path(first.path) / "m.safetensors").read_bytes()
    identity = read_manifest(root.manifest_path(first.entry_id)).identity
    assert remove_entry(root, first.entry_id)
    bystander = publish_files(root, "s3://models/unused/", {"w.bin": b"u" * 1000})
    free = os.statvfs(root.path).f_bavail * os.statvfs(root.path).f_frsize
    filler = tmpfs / "filler"  # leave room for about one and a half copies
    filler.write_bytes(b"\0" * max(free - size * 3 // 2, 0))

    outcome: dict[str, object] = {}
    with begin_publication(root, first.entry_id, expected_bytes=size, lock_timeout_s=5) as pub:
        assert pub.tmp_dir is not None
        with (pub.tmp_dir / "m.safetensors").open("wb") as handle:  # the first loader's files
            os.posix_fallocate(handle.fileno(), 0, size)

        def second_loader() -> None:
            try:
                outcome["result"] = _fill_here(s3, root.path, source, 0)
            except Exception as exc:  # reported by the assertion below
                outcome["error"] = exc

        watch = OpenWatch(root.publish_lock(first.entry_id))
        waiting = threading.Thread(target=second_loader)
        waiting.start()
        watch.wait()  # the second loader listed and now tries the lock this publication holds
        watch.close()
        (pub.tmp_dir / "m.safetensors").write_bytes(data)
        pub.commit("checkpoint", identity, [FileRecord("m.safetensors", size)])
    waiting.join(60)
    assert "error" not in outcome, outcome.get("error")
    result = outcome["result"]
    assert isinstance(result, FillResult) and result.cached
    assert result.entry_id == first.entry_id
    assert bystander in {info.entry_id for info in list_entries(root)}  # nothing evicted
