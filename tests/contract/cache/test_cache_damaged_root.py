"""One damaged or foreign item under a cache root: an invalid entry, never a crash.

The loader runs eviction (`make_room`) before every fill of any model on the node, and `dlo
cache ls`/`gc` list every entry: one unreadable manifest or one stray file must not stop them."""

from __future__ import annotations

import json
import os

from support.cache_helpers import dlo, publish_files
from dlo_contract.cache import CacheRoot, find_entry, list_entries, make_room


def _damage_manifest_high_bit(root: CacheRoot, entry: str) -> None:
    """One flipped high bit in the manifest (bit rot): the JSON is now invalid UTF-8."""
    path = root.manifest_path(entry)
    data = bytearray(path.read_bytes())
    data[10] |= 0x80
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))


def test_reader_calls_a_bit_rotted_manifest_unusable(root: CacheRoot) -> None:
    bad = publish_files(root, "s3://b/bad/", {"w.bin": b"b" * 100})
    _damage_manifest_high_bit(root, bad)
    assert find_entry(root, bad) is None  # then the fill would replace it


def test_ls_lists_a_bit_rotted_manifest_as_invalid(root: CacheRoot) -> None:
    good = publish_files(root, "s3://b/good/", {"w.bin": b"g" * 100})
    bad = publish_files(root, "s3://b/bad/", {"w.bin": b"b" * 100})
    _damage_manifest_high_bit(root, bad)
    kinds = {info.entry_id: info.kind for info in list_entries(root)}
    assert kinds == {good: "checkpoint", bad: "invalid"}


def test_every_other_fill_on_the_node_still_makes_room(root: CacheRoot) -> None:
    """The loader calls make_room before every fill of ANY model on the node."""
    bad = publish_files(root, "s3://b/bad/", {"w.bin": b"b" * 100})
    _damage_manifest_high_bit(root, bad)
    removed = make_room(root, "f" * 64, incoming_bytes=100, max_bytes=150, min_free_bytes=0)
    assert removed == [bad]


def test_dlo_cache_gc_command_removes_a_bit_rotted_entry(root: CacheRoot) -> None:
    bad = publish_files(root, "s3://b/bad/", {"w.bin": b"b" * 100})
    _damage_manifest_high_bit(root, bad)
    done = dlo("cache", "gc", "--root", str(root.path), "--max-bytes", "1",
               "--min-free-bytes", "0")
    assert "Traceback" not in done.stderr, done.stderr[-400:]
    assert done.stdout.splitlines()[0] == f"evicted {bad}"


def test_a_manifest_whose_fields_have_the_wrong_types_is_invalid(root: CacheRoot) -> None:
    bad = publish_files(root, "s3://b/bad/", {"w.bin": b"b" * 100})
    path = root.manifest_path(bad)
    os.chmod(path, 0o644)
    data = json.loads(path.read_text())
    data["identity"] = None  # valid JSON, the wrong shape
    path.write_text(json.dumps(data))
    assert find_entry(root, bad) is None
    assert {info.entry_id: info.kind for info in list_entries(root)} == {bad: "invalid"}


def test_a_stray_file_in_tmp_does_not_stop_every_fill(root: CacheRoot) -> None:
    """A plain file named like `<id>.<x>` in v1/tmp: the sweep calls rmtree on it."""
    publish_files(root, "s3://b/a/", {"w.bin": b"a" * 100})
    (root.tmp / "abc.partial").write_bytes(b"left by someone")
    removed = make_room(root, "f" * 64, incoming_bytes=10, max_bytes=0, min_free_bytes=0)
    assert removed == []
