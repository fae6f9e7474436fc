"""Fills of different models into one node cache at the same time, with real `dlo cache fill`
processes: each reserves its bytes before it reads, so together they never take the entries
above `cache.max_bytes`; one that cannot get room waits for the fill in progress, or fails naming
the entries in use; a killed fill's reservation is reclaimed."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from dlo_bench.faultproxy import FaultPlan, FaultProxy
from dlo_bench.s3server import S3Server
from safetensors.numpy import save_file
from support.loader_fleet import OpenWatch, finish, upload_files, wait_until
from test_loader_eviction import _start
from dlo_contract.cache import CacheRoot, in_progress, list_entries

pytestmark = pytest.mark.slow


def _model(tmp: Path, s3: S3Server, prefix: str, seed: int) -> tuple[str, int]:
    local = tmp / prefix
    local.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    save_file({"w": rng.standard_normal(300_000, dtype=np.float32)}, str(local / "m.safetensors"))
    data = (local / "m.safetensors").read_bytes()
    return upload_files(s3, prefix, {"m.safetensors": data}, tmp / f"up-{prefix}"), len(data)


@contextlib.contextmanager
def _held_store(s3: S3Server) -> Iterator[FaultProxy]:
    """The store behind a proxy that holds every object read until the test lets them go
    (`reads_open`): a fill that stays in progress, having reserved its bytes, while the test
    acts."""
    with FaultProxy(s3.endpoint_url, FaultPlan()) as proxy:
        proxy.reads_open.clear()
        yield proxy


def _waiting_for_room(root: CacheRoot) -> None:
    """Until a fill has decided twice that it has no room (so it waits): the room lock is opened
    once per decision, and only by the second fill once the first has reserved."""
    first = OpenWatch(root.room_lock)
    first.wait()
    first.close()
    again = OpenWatch(root.room_lock)  # sees only decisions after the first one
    again.wait()
    again.close()


@pytest.mark.parametrize("first_keeps_running", [False, True])
def test_two_fills_of_different_models_keep_the_byte_limit_together(
        first_keeps_running: bool, s3: S3Server, tmp_path: Path) -> None:
    """The second fill starts while the first is reading: it waits for the first (whose
    reservation it counts), then evicts the first's entry once no pod uses it, or fails at once
    naming it when the first's pod holds it in use. Never are both entries in the cache."""
    root = CacheRoot(tmp_path / "cache")
    first_source, first_size = _model(tmp_path, s3, "room-first", seed=1)
    second_source, second_size = _model(tmp_path, s3, "room-second", seed=2)
    room_for_one = max(first_size, second_size) * 3 // 2
    extra = ("--keep-running",) if first_keeps_running else ()
    with _held_store(s3) as held:
        first = _start(tmp_path, held.url, root.path, first_source, room_for_one, "first", *extra)
        try:
            wait_until(lambda: bool(in_progress(root)) or first.poll() is not None)
            [reserved] = in_progress(root)
            second_process = _start(tmp_path, s3.endpoint_url, root.path, second_source,
                                    room_for_one, "second")
            _waiting_for_room(root)  # the second counts the first's reservation, and waits
            held.reads_open.set()  # the first fill reads, and publishes
            second = finish(0, second_process)
            entries = {info.entry_id: info for info in list_entries(root)}
        finally:
            if first_keeps_running:  # the pod ends (its exit status is the sidecar test's)
                first.kill()
            done = finish(0, first)
    assert done.summary["status"] == "ok", done.stderr
    assert done.summary["entry_id"] == reserved.entry_id
    assert sum(info.bytes for info in entries.values()) <= room_for_one
    if first_keeps_running:
        assert second.returncode == 1
        assert second.summary["error"].endswith(
            f"in use: {reserved.entry_id} ({first_size} bytes); fills in progress: none (hint: "
            "stop the pods that map the entries in use or raise cache.max_bytes)")
        assert list(entries) == [reserved.entry_id]
    else:
        assert second.returncode == 0, second.stderr
        assert second.summary["wait_seconds"]["room"] > 0  # it waited for the first fill
        assert list(entries) == [second.summary["entry_id"]]  # the first went once unused
        assert f"evicted cache entry {reserved.entry_id}" in second.stderr


def test_a_killed_fills_reservation_is_reclaimed(s3: S3Server, tmp_path: Path) -> None:
    root = CacheRoot(tmp_path / "cache")
    first_source, first_size = _model(tmp_path, s3, "killed-first", seed=3)
    second_source, _ = _model(tmp_path, s3, "killed-second", seed=4)
    room_for_one = first_size * 3 // 2
    with _held_store(s3) as held:  # its reads never end
        first = _start(tmp_path, held.url, root.path, first_source, room_for_one, "first")
        try:
            wait_until(lambda: bool(in_progress(root)) or first.poll() is not None)
            assert [fill.pid for fill in in_progress(root)] == [first.pid]
        finally:
            os.kill(first.pid, signal.SIGKILL)
            finish(0, first)
    second = finish(0, _start(tmp_path, s3.endpoint_url, root.path, second_source,
                              room_for_one, "second"))
    assert second.returncode == 0, second.stderr
    assert second.summary["wait_seconds"]["room"] == 0
    assert "reclaiming reservation" in second.stderr
    assert sorted(os.listdir(root.reservations)) == [".lock"]
    assert [info.entry_id for info in list_entries(root)] == [second.summary["entry_id"]]
