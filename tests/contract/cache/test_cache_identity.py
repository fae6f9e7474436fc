"""Entry ids and names: every node must derive the same id, and no name may escape an entry."""

from __future__ import annotations

import hashlib

import pytest
from dlo_contract.cache import (
    CacheError,
    ObjectIdentity,
    canonical_json,
    checkpoint_identity,
    entry_id,
    runtime_identity,
    safe_relpath,
)

CHECKPOINT_JSON = (
    '{"format":1,"kind":"checkpoint","objects":['
    '{"etag":"def","key":"a.safetensors","size":10,"version_id":"v1"},'
    '{"etag":"abc","key":"transformer/config.json","size":321,"version_id":null}],'
    '"source":"s3://models/flux/"}'
)


def test_checkpoint_id_is_sha256_of_canonical_json_whatever_the_listing_order() -> None:
    objects = [
        ObjectIdentity("transformer/config.json", 321, '"abc"'),
        ObjectIdentity("a.safetensors", 10, "def", "v1"),
    ]
    forward = checkpoint_identity("s3://models/flux/", objects)
    backward = checkpoint_identity("s3://models/flux/", list(reversed(objects)))
    assert canonical_json(forward) == CHECKPOINT_JSON
    assert entry_id(forward) == entry_id(backward)
    assert entry_id(forward) == hashlib.sha256(CHECKPOINT_JSON.encode()).hexdigest()
    assert entry_id(forward) == "5a9f5f4dc0c9379a0d24dcfbe323146828678bd7d520abe9668dc6cc3f835bc5"


def test_a_changed_etag_size_or_version_changes_the_id() -> None:
    base = [ObjectIdentity("w.safetensors", 10, "e1")]
    reference = entry_id(checkpoint_identity("s3://b/p/", base))
    for changed in (
        ObjectIdentity("w.safetensors", 11, "e1"),
        ObjectIdentity("w.safetensors", 10, "e2"),
        ObjectIdentity("w.safetensors", 10, "e1", "v2"),
    ):
        assert entry_id(checkpoint_identity("s3://b/p/", [changed])) != reference
    assert entry_id(checkpoint_identity("s3://b/q/", base)) != reference


def test_runtime_id_ignores_dict_order_and_refuses_dp_and_sp_ranks() -> None:
    one = runtime_identity({"tp_world_size": 2, "tp_rank": 1, "dtype": "bfloat16"}, "cd" * 32)
    two = runtime_identity({"dtype": "bfloat16", "tp_rank": 1, "tp_world_size": 2}, "cd" * 32)
    assert entry_id(one) == entry_id(two)
    assert entry_id(one) != entry_id(runtime_identity(dict(one["layout"], tp_rank=0), "cd" * 32))
    with pytest.raises(CacheError) as info:
        runtime_identity({"tp_rank": 0, "dp_rank": 1, "sp_rank": 0}, "cd" * 32)
    assert str(info.value) == (
        "runtime cache layout must not include dp_rank, sp_rank: processes that differ only in "
        "these share one entry"
    )


def test_checkpoint_identity_refuses_duplicate_and_escaping_keys() -> None:
    with pytest.raises(CacheError) as info:
        checkpoint_identity("s3://b/p/", [ObjectIdentity("a", 1, "e"), ObjectIdentity("a", 1, "e")])
    assert str(info.value) == "checkpoint lists object key 'a' twice"
    with pytest.raises(CacheError) as info:
        checkpoint_identity("s3://b/p/", [ObjectIdentity("../x", 1, "e")])
    assert str(info.value) == (
        "file name '../x' is not allowed in a cache entry: '..' escapes the entry"
    )


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("", "empty name"),
        ("/etc/passwd", "absolute path"),
        ("../secret", "'..' escapes the entry"),
        ("a/../../b", "'..' escapes the entry"),
        ("a\\..\\b", "contains a backslash"),
        ("C:/x", "starts with a drive letter"),
        ("a//b", "empty or '.' path component"),
        ("./a", "empty or '.' path component"),
        ("a/", "empty or '.' path component"),
        ("a\x00b", "contains NUL"),
        ("manifest.json", "manifest.json is reserved for the entry's manifest"),
    ],
)
def test_safe_relpath_refuses_names_that_escape_or_collide(name: str, reason: str) -> None:
    with pytest.raises(CacheError) as info:
        safe_relpath(name)
    assert str(info.value) == f"file name {name!r} is not allowed in a cache entry: {reason}"


def test_safe_relpath_accepts_nested_relative_names() -> None:
    for name in ("model.safetensors", "transformer/config.json", "a/b/manifest.json", "..a/b.."):
        assert safe_relpath(name) == name
