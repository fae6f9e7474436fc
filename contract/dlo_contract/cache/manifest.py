"""The entry manifest (`manifest.json`): schema, checks and JSON round trip.

Owns the versioned description of an entry: kind, identity, files with their sizes and digests,
tensor count, content digest, producer and creation time. The manifest is written last and is the
only proof that an entry is complete. Called by `publish` (write), `entry` and `evict` (read).
Must not hash files or take locks; it checks the document, not the bytes it describes.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
from dataclasses import dataclass, field
from typing import Any

from dlo_contract.cache.errors import CacheCorruptError, remove_command
from dlo_contract.cache.layout import relpath_problem

MANIFEST_SCHEMA_VERSION = 1
KINDS = ("checkpoint", "runtime")
_HEX = frozenset("0123456789abcdef")
DIGEST_HEX_DIGITS = {"sha256": 64, "crc64nvme": 16, "crc32c": 8, "crc32": 8, "xxh3-128": 32}
"""The digest algorithms a manifest may name, with the length of their lowercase hex digests.
`sha256` records use the format's first keys (`sha256`, `chunk_sha256`) and need no
`algorithm`; every other algorithm is named in the record (`algorithm`, `digest`,
`chunk_digests`)."""
DEFAULT_ALGORITHM = "sha256"


def _is_digest(value: object, algorithm: str) -> bool:
    return (isinstance(value, str) and len(value) == DIGEST_HEX_DIGITS[algorithm]
            and set(value) <= _HEX)


@dataclass(frozen=True, kw_only=False)
class FileRecord:
    """One file of an entry. Small files carry one `digest`; large ones `chunk_bytes` and one
    digest per chunk (the last chunk may be short), all of `algorithm`. A record with neither
    gets digests at commit."""

    name: str
    size: int
    digest: str | None = None
    chunk_bytes: int | None = None
    chunk_digests: tuple[str, ...] = ()
    algorithm: str = DEFAULT_ALGORITHM

    def __post_init__(self) -> None:
        object.__setattr__(self, "chunk_digests", tuple(self.chunk_digests))
        problem = self._problem()
        if problem:
            raise CacheCorruptError(f"file record {self.name!r}: {problem}")

    def _problem(self) -> str | None:
        name_problem = relpath_problem(self.name)
        if name_problem:
            return f"name not allowed: {name_problem}"
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size < 0:
            return f"size {self.size!r} is not a byte count"
        if self.algorithm not in DIGEST_HEX_DIGITS:
            return (f"digest algorithm {self.algorithm!r} is not one of "
                    f"{sorted(DIGEST_HEX_DIGITS)}")
        digits = DIGEST_HEX_DIGITS[self.algorithm]
        if self.digest is not None and not _is_digest(self.digest, self.algorithm):
            return f"{self.algorithm} {self.digest!r} is not {digits} lowercase hex digits"
        if self.chunk_bytes is None:
            return "chunk digests given without chunk_bytes" if self.chunk_digests else None
        if self.digest is not None:
            return "carries both a digest and a chunk list; expected one"
        if not isinstance(self.chunk_bytes, int) or self.chunk_bytes <= 0:
            return f"chunk_bytes {self.chunk_bytes!r} is not a positive byte count"
        expected = -(-self.size // self.chunk_bytes)
        if len(self.chunk_digests) != expected:
            return (
                f"{len(self.chunk_digests)} chunk digests for {self.size} bytes in chunks of "
                f"{self.chunk_bytes}; expected {expected}"
            )
        if not all(_is_digest(d, self.algorithm) for d in self.chunk_digests):
            return f"a chunk digest is not {digits} lowercase hex digits"
        return None

    @property
    def has_digests(self) -> bool:
        return self.digest is not None or self.chunk_bytes is not None

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"name": self.name, "size": self.size}
        sha256 = self.algorithm == "sha256"
        if not sha256:
            data["algorithm"] = self.algorithm
        if self.digest is not None:
            data["sha256" if sha256 else "digest"] = self.digest
        if self.chunk_bytes is not None:
            data["chunk_bytes"] = self.chunk_bytes
            data["chunk_sha256" if sha256 else "chunk_digests"] = list(self.chunk_digests)
        return data

    @classmethod
    def from_dict(cls, data: Any) -> FileRecord:
        if not isinstance(data, dict):
            raise CacheCorruptError(f"manifest file record is not an object: {data!r}")
        algorithm = data.get("algorithm", DEFAULT_ALGORITHM)
        if algorithm == "sha256":
            digest_key, chunks_key = "sha256", "chunk_sha256"
            allowed = {"name", "size", "sha256", "chunk_bytes", "chunk_sha256", "algorithm"}
        else:
            digest_key, chunks_key = "digest", "chunk_digests"
            allowed = {"name", "size", "digest", "chunk_bytes", "chunk_digests", "algorithm"}
        _reject_unknown(data, allowed, "file")
        try:
            return cls(
                name=data["name"], size=data["size"], digest=data.get(digest_key),
                chunk_bytes=data.get("chunk_bytes"), chunk_digests=data.get(chunks_key, ()),
                algorithm=algorithm,
            )
        except KeyError as exc:
            raise CacheCorruptError(f"manifest file record lacks {exc.args[0]!r}") from exc
        except TypeError as exc:
            raise CacheCorruptError(f"manifest file record is malformed: {exc}") from exc


def utc_now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """What `manifest.json` holds. `schema_version` lets a reader refuse a newer format."""

    schema_version: int = MANIFEST_SCHEMA_VERSION
    kind: str
    entry_id: str
    identity: dict[str, Any]
    files: tuple[FileRecord, ...]
    tensor_count: int | None = None
    content_digest: str | None = None
    producer: str = "dlo"
    created_at: str = field(default_factory=utc_now_iso)

    def __post_init__(self) -> None:
        object.__setattr__(self, "files", tuple(self.files))
        if self.schema_version != MANIFEST_SCHEMA_VERSION:
            raise CacheCorruptError(
                f"manifest schema_version {self.schema_version!r} is not supported; this reader "
                f"knows {MANIFEST_SCHEMA_VERSION}",
                hint=f"upgrade dlo, or remove the entry with: {remove_command(self.entry_id)}",
            )
        if self.kind not in KINDS:
            raise CacheCorruptError(f"manifest kind {self.kind!r} is not one of {KINDS}")
        names = [f.name for f in self.files]
        if len(set(names)) != len(names):
            raise CacheCorruptError("manifest lists a file name twice")
        if self.kind == "runtime" and not self.content_digest:
            raise CacheCorruptError("runtime manifest lacks its content_digest")

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def file(self, name: str) -> FileRecord | None:
        return next((f for f in self.files if f.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "kind": self.kind,
            "entry_id": self.entry_id,
            "identity": self.identity,
            "files": [f.to_dict() for f in self.files],
            "tensor_count": self.tensor_count,
            "content_digest": self.content_digest,
            "producer": self.producer,
            "created_at": self.created_at,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: Any) -> Manifest:
        if not isinstance(data, dict):
            raise CacheCorruptError("manifest is not a JSON object")
        version = data.get("schema_version")
        if version != MANIFEST_SCHEMA_VERSION:
            raise CacheCorruptError(
                f"manifest schema_version {version!r} is not supported; this reader "
                f"knows {MANIFEST_SCHEMA_VERSION}",
                hint="upgrade dlo, or remove the entry with: "
                     + remove_command(str(data.get("entry_id", "ENTRY_ID"))),
            )
        allowed = {"schema_version", "kind", "entry_id", "identity", "files", "tensor_count",
                   "content_digest", "producer", "created_at"}
        _reject_unknown(data, allowed, "manifest")
        for key, kind in (("kind", str), ("entry_id", str), ("identity", dict)):
            if not isinstance(data.get(key), kind):
                raise CacheCorruptError(f"manifest {key!r} is missing or not a {kind.__name__}: "
                                        f"{data.get(key)!r}")
        files = data.get("files")
        if not isinstance(files, list):
            raise CacheCorruptError("manifest 'files' is not a list")
        try:
            return cls(**{k: v for k, v in data.items() if k != "files"},
                       files=tuple(FileRecord.from_dict(f) for f in files))
        except TypeError as exc:
            raise CacheCorruptError(f"manifest is incomplete: {exc}") from exc

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CacheCorruptError(f"manifest is not valid JSON: {exc}") from exc
        return cls.from_dict(data)


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Parse one manifest file; `FileNotFoundError` passes through (no manifest = no entry).
    Whatever else makes it unreadable (bytes that are not UTF-8, a directory in its place) is
    `CacheCorruptError`: the entry is invalid, and listing, eviction and the next fill go on."""
    try:
        with open(path, "rb") as handle:
            text = handle.read().decode("utf-8")
    except FileNotFoundError:
        raise
    except UnicodeDecodeError as exc:
        raise CacheCorruptError(f"manifest {path} is not UTF-8 text: {exc}") from exc
    except OSError as exc:
        raise CacheCorruptError(f"manifest {path} cannot be read: {exc}") from exc
    return Manifest.from_json(text)


def _reject_unknown(data: dict[str, Any], allowed: set[str], what: str) -> None:
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise CacheCorruptError(f"{what} has unknown field(s) {', '.join(unknown)}")
