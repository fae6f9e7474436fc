"""The warmer reads ahead exactly the pod's entry, whole: every byte of each of its files (one
larger than a readahead step among them), and nothing of the other entries the node's cache
holds (another DOD's model would take the memory this pod's pages need)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from dlo_bench import page_cache
from dlo_contract.documents import EntryDocument
from dlo_contract.names import ENTRY_FILE_ENV
from dlo_runtime import prefetch

POD_FILES = {"transformer/a.safetensors": prefetch.STEP_BYTES + (1 << 20) + 5,
             "transformer/config.json": 100, "vae.bin": 3 << 20}
OTHER_FILES = {"transformer/b.safetensors": prefetch.STEP_BYTES + (2 << 20)}


def _entry(root: Path, entry_id: str, files: dict[str, int]) -> Path:
    entry = root / "v1" / "entries" / entry_id
    for name, size in files.items():
        (entry / name).parent.mkdir(parents=True, exist_ok=True)
        (entry / name).write_bytes(os.urandom(size))
    return entry


@pytest.fixture
def two_entries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """The pod's entry and another beside it in one cache root, both out of the page cache;
    the entry file names the pod's."""
    root = tmp_path / "cache"
    mine, other = _entry(root, "mine", POD_FILES), _entry(root, "other", OTHER_FILES)
    page_cache.evict([mine, other])
    entry_file = tmp_path / "entry.json"
    entry_file.write_text(EntryDocument(entry_id="mine", kind="checkpoint", root=str(root),
                                        path=str(mine), source="s3://m/mine/").to_json())
    monkeypatch.setenv(ENTRY_FILE_ENV, str(entry_file))
    monkeypatch.setattr(prefetch, "_started", {})
    return mine, other


def test_exactly_the_pods_entry_is_read_ahead_whole(
        two_entries: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    mine, other = two_entries
    asked: dict[Path, list[tuple[int, int]]] = {}
    advise = os.posix_fadvise

    def recorded(fd: int, offset: int, length: int, advice: int) -> None:
        if advice == os.POSIX_FADV_WILLNEED:
            path = Path(os.readlink(f"/proc/self/fd/{fd}"))
            asked.setdefault(path, []).append((offset, length))
        advise(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", recorded)
    warmer = prefetch.start()
    assert warmer is not None and warmer.wait(30)

    assert sorted(asked) == sorted(mine / name for name in POD_FILES)
    for name, size in POD_FILES.items():
        spans = sorted(asked[mine / name])
        assert spans[0][0] == 0 and sum(length for _, length in spans) == size
        assert all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:]))  # no gap, no overlap
    assert warmer.bytes_requested == sum(POD_FILES.values())

    total = sum(POD_FILES.values())
    deadline = time.monotonic() + 30  # readahead completes later, with no event to wait on
    while page_cache.resident_bytes([mine]) < total and time.monotonic() < deadline:
        time.sleep(0.05)
    assert page_cache.resident_bytes([mine]) == total
    assert page_cache.resident_bytes([other]) == 0
