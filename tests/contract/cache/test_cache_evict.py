"""Eviction: least recently used first, never an entry another process holds."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest
from support.cache_helpers import Workers, dlo, publish_files
from support.cache_worker import identity_for
from dlo_contract.cache import (
    CacheError,
    CacheRoot,
    FileRecord,
    begin_publication,
    entry_id,
    evict,
    list_entries,
    open_entry,
)

SIZE = 1000


def _publish_runtime(root: CacheRoot, seed: str) -> str:
    ident = identity_for(seed)
    entry = entry_id(ident)
    with begin_publication(root, entry, expected_bytes=SIZE, lock_timeout_s=1) as pub:
        (pub.tmp_dir / "weights.bin").write_bytes(b"w" * SIZE)
        pub.commit("runtime", ident, [FileRecord("weights.bin", SIZE)])
    return entry


def _use_in_order(root: CacheRoot, entries: list[str]) -> None:
    for entry in entries:
        # File times come from a coarse kernel clock (a few ms); keep the uses apart.
        time.sleep(0.02)
        with open_entry(root, entry):
            pass


def test_eviction_removes_lru_entries_and_skips_one_in_use(
    root: CacheRoot, workers: Workers, tmp_path: Path
) -> None:
    held, old, middle, new = (_publish_runtime(root, s) for s in ("held", "old", "middle", "new"))
    _use_in_order(root, [held, old, middle, new])
    marker = tmp_path / "holding"
    holder = workers.start("hold-use", str(root.path), "held", "--marker", str(marker))
    workers.wait_for(marker, holder)
    before = {info.entry_id: info for info in list_entries(root)}
    assert before[held].in_use and not before[old].in_use
    assert [i.entry_id for i in list_entries(root)] == [
        old,
        middle,
        new,
        held,
    ]  # the holder used it

    assert evict(root, max_bytes=2 * SIZE, min_free_bytes=0) == [old, middle]
    assert sorted(root.entry_ids()) == sorted([held, new])
    assert evict(root, max_bytes=0, min_free_bytes=0) == []
    assert evict(root, max_bytes=SIZE, min_free_bytes=0, keep=[new]) == []  # held is in use

    assert Workers.result(holder) == {"held": True}
    assert evict(root, max_bytes=SIZE, min_free_bytes=0, keep=[new]) == [held]
    assert root.entry_ids() == [new]
    assert sorted(os.listdir(root.locks)) == [f"{new}.publish", f"{new}.use"]
    assert os.listdir(root.tmp) == []


def test_free_space_floor_evicts_until_it_holds(root: CacheRoot) -> None:
    entries = [_publish_runtime(root, s) for s in ("a", "b")]
    _use_in_order(root, entries)
    stats = os.statvfs(root.entries)
    impossible = stats.f_blocks * stats.f_frsize  # more than the disk can ever have free
    assert evict(root, max_bytes=0, min_free_bytes=impossible) == entries
    assert list_entries(root) == []


@pytest.mark.slow
def test_gc_and_ls_commands(root: CacheRoot, workers: Workers, tmp_path: Path) -> None:
    first = publish_files(root, "s3://b/one/", {"w.bin": b"1" * 600})
    held = _publish_runtime(root, "held")
    _use_in_order(root, [first, held])
    holder = workers.start("hold-use", str(root.path), "held", "--marker", str(tmp_path / "hold"))
    workers.wait_for(tmp_path / "hold", holder)
    stale_writer = workers.start(
        "publish", str(root.path), "dead", "--marker", str(tmp_path / "half"), "--hold-s", "60"
    )
    workers.wait_for(tmp_path / "half", stale_writer)
    stale_writer.kill()
    stale_writer.wait()

    listed = dlo("cache", "ls", "--root", str(root.path), "--json")
    assert [
        (e["entry_id"], e["kind"], e["bytes"], e["in_use"]) for e in json.loads(listed.stdout)
    ] == [(first, "checkpoint", 600, False), (held, "runtime", SIZE, True)]
    table = dlo("cache", "ls", "--root", str(root.path)).stdout.splitlines()
    assert table[0].split() == ["ENTRY", "KIND", "BYTES", "LAST", "USED", "(UTC)", "IN", "USE"]
    assert [line.split()[:3] + line.split()[-1:] for line in table[1:3]] == [
        [first, "checkpoint", "600", "no"],
        [held, "runtime", str(SIZE), "yes"],
    ]
    assert table[3] == f"2 entries, {600 + SIZE} bytes in {root.path}"

    done = dlo(
        "cache", "gc", "--root", str(root.path), "--max-bytes", "100", "--min-free-bytes", "0"
    )
    assert done.returncode == 1
    lines = done.stdout.splitlines()
    assert lines[0] == f"evicted {first}"
    assert re.fullmatch(rf"1 evicted; {SIZE} bytes in entries, \d+ bytes free", lines[1])
    assert lines[2] == (
        "limits not met (max 100 bytes, min free 0 bytes, incoming 0 bytes): the entries left "
        f"are in use ({held}), or the space is taken outside the cache"
    )
    assert root.entry_ids() == [held]
    assert os.listdir(root.tmp) == []  # the dead writer's tmp dir went too
    assert entry_id(identity_for("dead")) not in {n.split(".")[0] for n in os.listdir(root.locks)}

    assert Workers.result(holder) == {"held": True}
    done = dlo(
        "cache", "gc", "--root", str(root.path), "--max-bytes", "100", "--min-free-bytes", "0"
    )
    assert (done.returncode, done.stdout.splitlines()[0]) == (0, f"evicted {held}")
    assert root.entry_ids() == []


def test_gc_removes_a_named_entry_unless_it_is_in_use(
        root: CacheRoot, workers: Workers, tmp_path: Path) -> None:
    """A damaged entry whose manifest still reads is neither invalid nor old: errors about it
    name `dlo cache gc --remove`, which takes it out whatever its last use."""
    damaged = publish_files(root, "s3://b/damaged/", {"w.bin": b"d" * 600})
    (root.entry_dir(damaged) / "w.bin").chmod(0o644)
    (root.entry_dir(damaged) / "w.bin").write_bytes(b"d" * 599)  # a short file
    with pytest.raises(CacheError) as opening:
        open_entry(root, damaged)
    assert opening.value.hint.endswith(f"dlo cache gc --root {root.path} --remove {damaged}")
    held = _publish_runtime(root, "held")
    holder = workers.start("hold-use", str(root.path), "held", "--marker", str(tmp_path / "hold"))
    workers.wait_for(tmp_path / "hold", holder)

    done = dlo("cache", "gc", "--root", str(root.path), "--remove", damaged, "--remove", held,
               "--remove", "f" * 64, "--max-bytes", "0", "--min-free-bytes", "0")

    assert done.returncode == 1  # not everything named could go
    assert done.stdout.splitlines()[:3] == [
        f"removed {damaged}",
        f"not removed: {held} is in use (or being published); stop the pods that map it",
        f"no entry {'f' * 64} in {root.path}",
    ]
    assert root.entry_ids() == [held]
    refused = dlo("cache", "gc", "--root", str(root.path), "--remove", "../x")
    assert refused.returncode == 2 and "'../x' is not an entry id" in refused.stderr
    assert Workers.result(holder) == {"held": True}
