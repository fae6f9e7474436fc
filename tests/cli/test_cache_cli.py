"""The `dlo cache` commands find the cache root and limits in the settings document."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from support.cache_helpers import dlo, publish_files
from dlo_contract.cache import CacheRoot
from dlo_contract.settings import CacheConfig, Settings


def _dlo_with_settings(settings_file: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return dlo(*args, env={"DLO_CONFIG": str(settings_file)})


@pytest.mark.slow
def test_root_and_limits_default_to_the_settings_document(root: CacheRoot, tmp_path: Path) -> None:
    old = publish_files(root, "s3://b/old/", {"w.bin": b"o" * 700})
    new = publish_files(root, "s3://b/new/", {"w.bin": b"n" * 700})
    os.utime(root.use_lock(old), (1_000_000, 1_000_000))  # used long ago
    settings_file = tmp_path / "settings.json"
    settings = Settings(cache=CacheConfig(root=str(root.path), max_bytes=1000))
    settings_file.write_text(settings.to_json())

    listed = _dlo_with_settings(settings_file, "cache", "ls", "--json")
    assert [e["entry_id"] for e in json.loads(listed.stdout)] == [old, new]
    done = _dlo_with_settings(settings_file, "cache", "gc")
    assert (done.returncode, done.stdout.splitlines()[0]) == (0, f"evicted {old}")
    assert root.entry_ids() == [new]


def test_a_named_settings_document_that_is_missing_is_an_error(tmp_path: Path) -> None:
    done = _dlo_with_settings(tmp_path / "absent.json", "cache", "ls")
    assert done.returncode == 1
    assert done.stderr == (
        f"dlo: error: cannot read settings document {tmp_path / 'absent.json'}: No such file or "
        "directory (hint: pass --config FILE or set DLO_CONFIG)\n"
    )


def test_gc_refuses_limits_the_validator_refuses(root: CacheRoot, tmp_path: Path) -> None:
    """The gc reads its limits from the validated document: a negative limit is not taken as
    'no limit'."""
    settings_file = tmp_path / "settings.json"
    document = Settings(cache=CacheConfig(root=str(root.path))).to_dict()
    document["cache"]["max_bytes"] = -5
    settings_file.write_text(json.dumps(document))
    done = _dlo_with_settings(settings_file, "cache", "gc")
    assert done.returncode == 1
    assert done.stderr == "dlo: error: invalid settings: cache.max_bytes=-5 must be 0 or more\n"
