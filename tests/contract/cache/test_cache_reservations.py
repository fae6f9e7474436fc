"""Reservations: a publication counts its bytes before it writes, so concurrent publications of
different entries keep the limits together; a dead publisher's reservation is reclaimed; one
that would fit once the others are done waits for them."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest
from support.cache_helpers import Workers, publish_files
from support.cache_worker import identity_for
from support.loader_fleet import OpenWatch
from dlo_contract.cache import (
    CacheRoot,
    CacheSpaceError,
    FileRecord,
    RoomLimits,
    begin_publication,
    entry_id,
    in_progress,
    list_entries,
    open_entry,
)

FIRST, SECOND = entry_id(identity_for("first")), entry_id(identity_for("second"))
SIZE = 300_000


def test_a_publication_in_progress_counts_against_the_byte_limit(root: CacheRoot) -> None:
    limits = RoomLimits(max_bytes=SIZE * 3 // 2, evict=True)
    with begin_publication(root, FIRST, expected_bytes=SIZE, lock_timeout_s=5, room=limits):
        [fill] = in_progress(root)
        assert (fill.entry_id, fill.bytes, fill.pid) == (FIRST, SIZE, os.getpid())
        with (pytest.raises(CacheSpaceError) as info,
              begin_publication(root, SECOND, expected_bytes=SIZE, lock_timeout_s=5,
                                room=limits)):
            raise AssertionError("the second publication must not start")
    assert str(info.value) == (
        f"no room for cache entry {SECOND} ({SIZE} bytes) in {root.path}: 0 bytes in entries "
        f"and {SIZE} bytes reserved by fills in progress (cache.max_bytes={SIZE * 3 // 2}), "
        f"{info.value.free_bytes} bytes free (cache.min_free_bytes=0) after evicting 0 unused "
        f"entries; in use: none; fills in progress: {fill.describe()}")
    # Nothing is in use: no pods to stop (the hint said to stop them, with "in use: none").
    assert info.value.hint == ("raise cache.max_bytes; or retry once the fills in progress are "
                               "done")
    assert in_progress(root) == [] and os.listdir(root.tmp) == []


def test_a_publication_waits_for_the_one_in_progress_and_takes_the_room_it_leaves(
        root: CacheRoot) -> None:
    limits = RoomLimits(max_bytes=SIZE * 3 // 2, evict=True, timeout_s=60)
    outcome: dict[str, object] = {}
    second = threading.Thread(target=_publish_second, args=(root, limits, outcome))

    first = begin_publication(root, FIRST, expected_bytes=SIZE, lock_timeout_s=5, room=limits)
    first.__enter__()
    try:
        watch = OpenWatch(root.room_lock)
        second.start()
        watch.wait()  # the second publication takes the room lock to decide
        watch.close()
        again = OpenWatch(root.room_lock)  # sees only later decisions
        again.wait()  # it decides again: the first found no room beside this one, it waits
        again.close()
    finally:
        first.__exit__(None, None, None)  # the first gives up: its reservation goes
    second.join(60)
    assert "error" not in outcome, outcome.get("error")
    assert isinstance(outcome["waited"], float) and outcome["waited"] > 0
    assert [info.entry_id for info in list_entries(root)] == [SECOND]


def test_entries_in_use_fail_a_publication_at_once_naming_them(root: CacheRoot) -> None:
    held = publish_files(root, "s3://models/held/", {"w.bin": b"h" * SIZE})
    limits = RoomLimits(max_bytes=SIZE * 3 // 2, evict=True, timeout_s=600)
    with open_entry(root, held), pytest.raises(CacheSpaceError) as info:
        with begin_publication(root, SECOND, expected_bytes=SIZE, lock_timeout_s=5,
                               room=limits):
            raise AssertionError("no room beside the entry in use")
    assert str(info.value).endswith(
        f"after evicting 0 unused entries; in use: {held} ({SIZE} bytes); fills in progress: "
        "none")  # at once: waiting would not help
    assert info.value.hint == ("stop the pods that map the entries in use or raise "
                               "cache.max_bytes")


def test_a_killed_publishers_reservation_is_reclaimed(
        root: CacheRoot, tmp_path: Path, workers: Workers) -> None:
    writer = workers.start("publish", str(root.path), "first", "--size", str(SIZE), "--marker",
                           str(tmp_path / "halfway"), "--hold-s", "600")
    workers.wait_for(tmp_path / "halfway", writer)
    assert [fill.pid for fill in in_progress(root)] == [writer.pid]
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait()
    limits = RoomLimits(max_bytes=SIZE * 3 // 2, evict=True)
    with begin_publication(root, SECOND, expected_bytes=SIZE, lock_timeout_s=5,
                           room=limits) as pub:
        assert pub.waited_room_s == 0.0
        assert [fill.pid for fill in in_progress(root)] == [os.getpid()]
    assert sorted(os.listdir(root.reservations)) == [".lock"]


def test_a_publication_that_just_committed_is_waited_for_not_counted_twice(
        root: CacheRoot) -> None:
    """Between its commit and its end, a publication's entry is there and its reservation too
    (and its `.publish` keeps the entry from eviction): a publication deciding then waits for
    it to end, then evicts the entry nobody uses; it must not fail as if both were in use."""
    limits = RoomLimits(max_bytes=SIZE * 3 // 2, evict=True, timeout_s=60)
    outcome: dict[str, object] = {}
    second = threading.Thread(target=_publish_second, args=(root, limits, outcome))

    with begin_publication(root, FIRST, expected_bytes=SIZE, lock_timeout_s=5,
                           room=limits) as first:
        assert first.tmp_dir is not None
        (first.tmp_dir / "w.bin").write_bytes(b"f" * SIZE)
        first.commit("runtime", identity_for("first"), [FileRecord("w.bin", SIZE)])
        watch = OpenWatch(root.room_lock)
        second.start()
        watch.wait()  # the second decides while the first's entry and reservation are both here
        watch.close()
        again = OpenWatch(root.room_lock)
        again.wait()  # and decides again: it waits
        again.close()
    second.join(60)
    assert "error" not in outcome, outcome.get("error")
    assert [info.entry_id for info in list_entries(root)] == [SECOND]


def _publish_second(root: CacheRoot, limits: RoomLimits, outcome: dict[str, object]) -> None:
    """Publish SECOND (waiting up to 60 s for room), recording how long it waited for room, or
    the error, in `outcome` (a thread's exception would otherwise be lost)."""
    try:
        with begin_publication(root, SECOND, expected_bytes=SIZE, lock_timeout_s=60,
                               room=limits) as pub:
            assert pub.tmp_dir is not None
            (pub.tmp_dir / "w.bin").write_bytes(b"s" * SIZE)
            pub.commit("runtime", identity_for("second"), [FileRecord("w.bin", SIZE)])
            outcome["waited"] = pub.waited_room_s
    except Exception as exc:  # reported by the caller's assertion
        outcome["error"] = exc
