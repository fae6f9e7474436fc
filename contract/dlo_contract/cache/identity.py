"""Canonical identities of cache entries, and the ids derived from them.

Owns what makes two entries "the same": for a checkpoint, the source URI and every object's key,
size, ETag and version id; for a runtime entry, the layout (TP world size and rank, SP guards,
dtype, loader source) plus the final content digest. The id is the hex SHA-256 of the identity
as canonical JSON, so every node and every process computes the same id without talking. Called
by the loader (checkpoint kind), the runtime cache (runtime kind) and `publish` (to check that an
id matches its identity). Must not touch the filesystem.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from dlo_contract.cache.errors import CacheError
from dlo_contract.cache.layout import safe_relpath
from dlo_contract.field_names import Names, document_names

IDENTITY_FORMAT = 1
# Ranks that only pick which slice of the same bytes a process uses: two processes that differ
# only in these must share one runtime entry (docs/design.md section 4).
_EXCLUDED_LAYOUT_KEYS = ("dp_rank", "sp_rank")


@dataclass(frozen=True, kw_only=False)
class ObjectIdentity:
    """One object of a checkpoint as the object store describes it."""

    key: str
    """Key relative to the source prefix; becomes the file name inside the entry."""
    size: int
    """Bytes."""
    etag: str
    """The store's entity tag; surrounding quotes are dropped so LIST and HEAD agree."""
    version_id: str | None = None
    """Object version where the bucket is versioned, else None."""


def canonical_json(value: Any) -> str:
    """Sorted keys, no whitespace, ASCII only, no NaN: one byte string per value."""
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise CacheError(f"cache identity is not plain JSON: {exc}") from exc


def entry_id(identity: Mapping[str, Any]) -> str:
    """Hex SHA-256 of the identity's canonical JSON."""
    return hashlib.sha256(canonical_json(dict(identity)).encode("ascii")).hexdigest()


def checkpoint_identity(source_uri: str, objects: Iterable[ObjectIdentity],
                        names: Names = document_names) -> dict[str, Any]:
    """Identity of a checkpoint entry: the listing it was filled from, sorted by key; an empty
    listing is an error naming the source settings as `names` spells them."""
    rows: dict[str, dict[str, Any]] = {}
    for obj in objects:
        key = safe_relpath(obj.key)
        if key in rows:
            raise CacheError(f"checkpoint lists object key {key!r} twice")
        if not isinstance(obj.size, int) or obj.size < 0:
            raise CacheError(f"object {key!r} has invalid size {obj.size!r}; expected bytes >= 0")
        rows[key] = {
            "key": key,
            "size": obj.size,
            "etag": obj.etag.strip('"'),
            "version_id": obj.version_id,
        }
    if not rows:
        raise CacheError(
            f"checkpoint {source_uri!r} has no objects",
            hint=f"check {names('loader.source')} and {names('loader.include')}",
        )
    return {
        "format": IDENTITY_FORMAT,
        "kind": "checkpoint",
        "source": source_uri,
        "objects": [rows[key] for key in sorted(rows)],
    }


def runtime_identity(layout: Mapping[str, Any], content_digest: str) -> dict[str, Any]:
    """Identity of a runtime entry: the layout that produced the tensors plus their digest."""
    excluded = sorted(k for k in _EXCLUDED_LAYOUT_KEYS if k in layout)
    if excluded:
        raise CacheError(
            f"runtime cache layout must not include {', '.join(excluded)}: processes that differ "
            "only in these share one entry",
            hint="drop the DP and SP ranks from the layout identity",
        )
    if not content_digest:
        raise CacheError("runtime cache identity needs a content digest, found an empty one")
    canonical_json(dict(layout))
    return {
        "format": IDENTITY_FORMAT,
        "kind": "runtime",
        "layout": dict(layout),
        "content_digest": content_digest,
    }
