"""The manifest document and the digest rules that several writers share."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from dlo_contract.cache import (
    CacheCorruptError,
    FileRecord,
    Manifest,
    chunk_digests,
    entry_id,
    file_record,
    runtime_identity,
    sha256_file,
)


def _manifest() -> Manifest:
    ident = runtime_identity({"tp_rank": 0}, "ef" * 32)
    return Manifest(
        kind="runtime",
        entry_id=entry_id(ident),
        identity=ident,
        files=(
            FileRecord("a.safetensors", 5, digest="00" * 32),
            FileRecord("b.safetensors", 10, chunk_bytes=4, chunk_digests=("11" * 32,) * 3),
        ),
        tensor_count=7,
        content_digest="ef" * 32,
        producer="test",
        created_at="2025-01-02T03:04:05+00:00",
    )


def test_manifest_round_trips_through_json() -> None:
    manifest = _manifest()
    assert Manifest.from_json(manifest.to_json()) == manifest
    assert manifest.total_bytes == 15
    assert json.loads(manifest.to_json())["schema_version"] == 1


def test_a_newer_schema_version_is_refused_with_a_hint() -> None:
    data = json.loads(_manifest().to_json())
    data["schema_version"] = 2
    data["future_field"] = True
    with pytest.raises(CacheCorruptError) as info:
        Manifest.from_dict(data)
    assert str(info.value) == "manifest schema_version 2 is not supported; this reader knows 1"
    assert info.value.hint == ("upgrade dlo, or remove the entry with: dlo cache gc --remove "
                               + data["entry_id"])


def test_file_records_must_describe_their_chunks_consistently() -> None:
    with pytest.raises(CacheCorruptError) as info:
        FileRecord("b", 10, chunk_bytes=4, chunk_digests=("11" * 32,) * 2)
    assert str(info.value) == (
        "file record 'b': 2 chunk digests for 10 bytes in chunks of 4; expected 3"
    )
    with pytest.raises(CacheCorruptError) as info:
        FileRecord("../b", 1)
    assert str(info.value) == "file record '../b': name not allowed: '..' escapes the entry"


def test_chunk_ranges_hashed_apart_equal_the_whole_list(tmp_path: Path) -> None:
    data = bytes(range(256)) * 41  # 10496 bytes: 10 full chunks of 1000 and a short one
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    whole = chunk_digests(path, 1000)
    assert len(whole) == 11
    assert whole == chunk_digests(path, 1000, 0, 4) + chunk_digests(path, 1000, 4, None)
    assert whole[10] == hashlib.sha256(data[10000:]).hexdigest()
    assert chunk_digests(path, 1000, 9, 50) == whole[9:]
    assert sha256_file(path) == hashlib.sha256(data).hexdigest()


def test_file_record_uses_a_chunk_list_only_above_one_chunk(tmp_path: Path) -> None:
    small, large = tmp_path / "small", tmp_path / "large"
    small.write_bytes(b"x" * 1000)
    large.write_bytes(b"y" * 1001)
    assert file_record(small, "small", chunk_bytes=1000) == FileRecord(
        "small", 1000, digest=hashlib.sha256(b"x" * 1000).hexdigest()
    )
    record = file_record(large, "large", chunk_bytes=1000)
    assert (record.digest, record.chunk_bytes, len(record.chunk_digests)) == (None, 1000, 2)
