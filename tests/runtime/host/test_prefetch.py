"""Warming the page cache with the pod's entry: a cold entry becomes resident without the
server reading it, once per entry, and never for an entry the memory cannot hold."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

from dlo_bench import page_cache
from dlo_contract.documents import EntryDocument
from dlo_contract.names import ENTRY_FILE_ENV, ENTRY_WAIT_ENV
from dlo_runtime import prefetch


@pytest.fixture
def cold_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An entry directory of three files (the DiT's shard first), out of the page cache, named
    by the entry file in the environment."""
    entry = tmp_path / "entries" / "abc"
    (entry / "transformer").mkdir(parents=True)
    for name, size in (("transformer/a.safetensors", 6 << 20), ("transformer/config.json", 100),
                       ("vae.bin", 3 << 20)):
        (entry / name).write_bytes(os.urandom(size))
    page_cache.evict([entry])
    entry_file = tmp_path / "entry.json"
    entry_file.write_text(EntryDocument(entry_id="abc", kind="checkpoint", root=str(tmp_path),
                                        path=str(entry), source="s3://m/abc/").to_json())
    monkeypatch.setenv(ENTRY_FILE_ENV, str(entry_file))
    monkeypatch.setattr(prefetch, "_started", {})
    return entry


def test_a_cold_entry_becomes_resident(cold_entry: Path) -> None:
    assert page_cache.resident_bytes([cold_entry]) == 0
    warmer = prefetch.start()
    assert warmer is not None and warmer.wait(30)
    total = sum(p.stat().st_size for p in page_cache.files_under([cold_entry]))
    assert warmer.bytes_requested == total
    deadline = time.monotonic() + 30  # readahead is asynchronous: the reads complete later
    while page_cache.resident_bytes([cold_entry]) < total and time.monotonic() < deadline:
        time.sleep(0.05)
    assert page_cache.resident_bytes([cold_entry]) == total
    assert [p.name for p in warmer.files][:2] == ["a.safetensors", "config.json"]


def test_one_warmer_per_entry(cold_entry: Path) -> None:
    first = prefetch.start()
    assert first is not None and prefetch.start() is first


def test_an_entry_larger_than_half_the_available_memory_is_left_alone(
        cold_entry: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefetch, "_available_bytes", lambda: 8 << 20)
    assert prefetch.start() is None
    assert page_cache.resident_bytes([cold_entry]) == 0


def test_no_entry_file_means_nothing_to_warm(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENTRY_FILE_ENV, str(tmp_path / "absent.json"))
    assert prefetch.start() is None


def test_a_wait_for_the_sidecar_starts_the_warmer_once_the_entry_is_published(
        cold_entry: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The server calls `start()` before the loader sidecar published: a thread waits for the
    entry document, quietly (the server's own wait says it waits), and warms the entry when it
    appears."""
    caplog.set_level(logging.INFO, logger="dlo_runtime.entry_file")
    published = tmp_path / "entry.json"
    document = published.read_text()
    published.unlink()
    monkeypatch.setattr(prefetch, "_waiting", set())
    monkeypatch.setenv(ENTRY_WAIT_ENV, "30")
    assert prefetch.start() is None
    time.sleep(0.2)
    assert prefetch._started == {}
    published.write_text(document)
    deadline = time.monotonic() + 30
    while not prefetch._started and time.monotonic() < deadline:
        time.sleep(0.02)
    warmer = prefetch._started[cold_entry]
    assert warmer.wait(30) and prefetch.start() is warmer
    assert [r.getMessage() for r in caplog.records if r.name == "dlo_runtime.entry_file"] == []


def test_without_a_wait_an_absent_entry_file_starts_nothing(
        cold_entry: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "entry.json").unlink()
    monkeypatch.setattr(prefetch, "_waiting", set())
    monkeypatch.delenv(ENTRY_WAIT_ENV, raising=False)
    assert prefetch.start() is None
    assert prefetch._waiting == set()
