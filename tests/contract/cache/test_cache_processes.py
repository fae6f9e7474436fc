"""Publication across real processes: one writer among racers, and a writer killed mid-write."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from support.cache_helpers import Workers
from support.cache_worker import identity_for, payload
from dlo_contract.cache import (
    CacheRoot,
    entry_id,
    find_entry,
    open_entry,
    read_manifest,
    verify_entry,
)
from dlo_contract.cache.locks import try_lock

SIZE = 3 << 20


@pytest.mark.slow
def test_four_racing_publishers_one_writes_all_hold_the_same_entry(
    root: CacheRoot, workers: Workers, tmp_path: Path
) -> None:
    go = tmp_path / "go"
    procs = [
        workers.start(
            "publish",
            str(root.path),
            "race",
            "--size",
            str(SIZE),
            "--go",
            str(go),
            "--hold-s",
            "0.3",
        )
        for _ in range(4)
    ]
    go.touch()  # all four start their publication at once
    results = [Workers.result(proc) for proc in procs]
    entry = entry_id(identity_for("race"))
    assert sorted(r["wrote"] for r in results) == [False, False, False, True]
    assert {r["path"] for r in results} == {str(root.entry_dir(entry))}
    writer = procs[[r["wrote"] for r in results].index(True)]
    assert read_manifest(root.manifest_path(entry)).producer == f"pid-{writer.pid}"
    assert verify_entry(root, entry, full=True) == []
    assert (root.entry_dir(entry) / "weights.bin").read_bytes() == payload("race", SIZE)
    assert os.listdir(root.tmp) == []


@pytest.mark.slow
def test_a_writer_killed_mid_publication_leaves_no_entry_and_a_free_lock(
    root: CacheRoot, workers: Workers, tmp_path: Path
) -> None:
    marker = tmp_path / "halfway"
    victim = workers.start(
        "publish",
        str(root.path),
        "killed",
        "--size",
        str(SIZE),
        "--marker",
        str(marker),
        "--hold-s",
        "60",
    )
    workers.wait_for(marker, victim)
    victim.send_signal(signal.SIGKILL)
    assert victim.wait() == -signal.SIGKILL
    entry = entry_id(identity_for("killed"))
    assert find_entry(root, entry) is None
    assert not root.entry_dir(entry).exists()
    stale = root.tmp_dirs(entry)
    assert [p.name.split(".")[1].split("-")[0] for p in stale] == [str(victim.pid)]
    lock = try_lock(root.publish_lock(entry))  # the kernel dropped the dead writer's flock
    assert lock is not None
    lock.release()

    successor = workers.start("publish", str(root.path), "killed", "--size", str(SIZE))
    assert Workers.result(successor) == {"wrote": True, "path": str(root.entry_dir(entry))}
    assert root.tmp_dirs(entry) == []
    with open_entry(root, entry, verify="full") as handle:
        assert handle.file_path("weights.bin").read_bytes() == payload("killed", SIZE)
