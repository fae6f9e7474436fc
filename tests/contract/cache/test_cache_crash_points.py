"""Publication killed at every step (SIGKILL, real process): after each crash no entry exists
without a complete manifest, no manifest names a missing or short file, the publish lock is
free, and the next publisher recovers. The steps themselves are checked in order, so dropping a
file, manifest or directory fsync, or renaming before the manifest is durable, fails here
(a killed process keeps its page cache, so only the recorded order can show an fsync)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from support.cache_helpers import Workers
from support.cache_worker import identity_for, payload

from dlo_contract.cache import CacheRoot, entry_id, open_entry, read_manifest, verify_entry
from dlo_contract.cache.locks import try_lock

SEED = "crash"
STEPS = [
    "write tmp/*/a.bin",
    "write tmp/*/b.bin",
    "fsync tmp/*/a.bin",
    "fsync tmp/*/b.bin",
    "fsync tmp/*",
    "write tmp/*/manifest.json",
    "fsync tmp/*/manifest.json",
    "fsync tmp/*",
    "rename tmp/* entries/*",
    "fsync entries",
    "create use lock",
    "unlock",
]
PUBLISHED_FROM = STEPS.index("rename tmp/* entries/*") + 1


def test_a_publication_takes_every_durable_step_in_order(root: CacheRoot, workers: Workers) -> None:
    result = Workers.result(workers.start("publish-steps", str(root.path), SEED))
    assert result == {"wrote": True, "steps": STEPS}


def _check_invariants(root: CacheRoot, entry: str) -> bool:
    """The invariants after a crash; returns whether the entry is there."""
    directory = root.entry_dir(entry)
    if not directory.exists():
        return False
    assert root.manifest_path(entry).is_file(), f"entry {entry} has no manifest"
    manifest = read_manifest(root.manifest_path(entry))  # raises when partial
    assert [record.name for record in manifest.files] == ["a.bin", "b.bin"]
    assert verify_entry(root, entry, full=True) == []
    return True


@pytest.mark.slow
@pytest.mark.parametrize("step", range(1, len(STEPS) + 1), ids=lambda n: STEPS[n - 1])
def test_a_writer_killed_at_any_step_leaves_a_valid_cache_and_a_free_lock(
    root: CacheRoot, workers: Workers, step: int
) -> None:
    entry = entry_id(identity_for(SEED))
    victim = workers.start("publish-steps", str(root.path), SEED, "--crash-at", str(step))
    victim.communicate(timeout=20)
    assert victim.returncode == -signal.SIGKILL
    assert _check_invariants(root, entry) is (step >= PUBLISHED_FROM)
    lock = try_lock(root.publish_lock(entry))  # the kernel dropped the dead writer's flock
    assert lock is not None
    lock.release()

    successor = Workers.result(workers.start("publish-steps", str(root.path), SEED))
    assert successor["wrote"] is (step < PUBLISHED_FROM)
    assert _check_invariants(root, entry)
    assert root.tmp_dirs(entry) == []
    with open_entry(root, entry, verify="full") as handle:
        assert Path(handle.file_path("a.bin")).read_bytes() == payload(SEED, 4096)
        assert Path(handle.file_path("b.bin")).read_bytes() == payload("b" + SEED, 96)
