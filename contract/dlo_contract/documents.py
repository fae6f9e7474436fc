"""The two documents one plane writes and another reads: the entry document and the fill summary.

`EntryDocument` is written by the loader to `names.DEFAULT_ENTRY_FILE` and read by the runtime in
the main container. `FillSummary` is the loader's one-line JSON result: the last line of its
stdout and its termination message, read by the operator into the DOD status. Both are typed
records with `to_dict`/`from_dict`, so writer and readers share one set of keys. Pure; no I/O
beyond the JSON text itself.
"""

from __future__ import annotations

import enum
import json
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any

from dlo_contract.errors import PermanentError


class DocumentError(PermanentError):
    """A cross-plane document is not what its writer should have written."""


@dataclass(frozen=True, kw_only=True)
class EntryDocument:
    """The cache entry this pod's loader filled or found, for the main container."""

    entry_id: str
    kind: str
    """`checkpoint` (object-store files byte for byte) or `runtime`."""
    root: str
    """The node-cache root the entry lives under."""
    path: str
    """The entry's directory."""
    source: str
    """The object-store URI it was filled from."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, data: Any) -> EntryDocument:
        return _from_dict(cls, data, "entry document")

    @classmethod
    def from_json(cls, text: str) -> EntryDocument:
        return cls.from_dict(_loads(text, "entry document"))


class FillStatus(str, enum.Enum):
    OK = "ok"
    ERROR = "error"


@dataclass(frozen=True, kw_only=True)
class GroupMember:
    """A member of a fill group as the group knew it (its pod and node, where it said)."""

    rank: int
    pod: str = ""
    node: str = ""


@dataclass(frozen=True, kw_only=True)
class PeerBytes:
    """What one node that holds the entry served to a loader refilling from it."""

    node: str
    """The holder's node name (its address and port where the fill-group document named no
    node)."""
    bytes: int


MAX_PEERS_LISTED = 16
"""The most holders a summary's `bytes_by_peer` lists (those that served the most): the
summary is also the loader's termination message, which Kubernetes cuts at 4 KiB."""


@dataclass(frozen=True, kw_only=True)
class FillSummary:
    """One loader's result. A failed fill carries `error`; a successful one the figures."""

    status: FillStatus
    rank: int | None = None
    world_size: int | None = None
    entry_id: str | None = None
    mode: str | None = None
    bytes_from_store: int | None = None
    bytes_from_peers: int | None = None
    bytes_to_peers: int | None = None
    seconds: float | None = None
    cached: bool | None = None
    """True when the entry was on the node already: nothing was read."""
    store_checksums: str | None = None
    """`all`/`some`/`none`: whether the bytes read matched the store's own checksums, of whole
    objects or of their upload's parts (objects of at least one chunk)."""
    stage_seconds: dict[str, float] | None = None
    """Where the fill's time went, thread-seconds per stage: get, digest, write, exchange."""
    wait_seconds: dict[str, float] | None = None
    """How long the loader waited, in seconds: for its group's loaders to join (`group`), for
    the nodes before its own in the group's order (`turn`), for another loader's publication
    of the entry on its node (`publication`), for room in the node cache (`room`)."""
    without: list[int] | None = None
    """The ranks of the group the fill finished without: members lost mid-fill, whose share
    the survivors moved among themselves."""
    bytes_read_again: int | None = None
    """Of `bytes_from_store`, what this loader read again for the members it finished
    without."""
    lost: list[GroupMember] | None = None
    """The members `without` names, with the pod and node each had in the group."""
    bytes_by_peer: list[PeerBytes] | None = None
    """Of `bytes_from_peers`, for a fill alone that read from the nodes that hold its entry:
    the bytes each holder served, most first, at most `MAX_PEERS_LISTED` of them."""
    error: str | None = None
    """One line: what went wrong and the hint, for the DOD status."""

    @property
    def ok(self) -> bool:
        return self.status is FillStatus.OK

    def to_dict(self) -> dict[str, Any]:
        data = {k: v for k, v in asdict(self).items() if v is not None}
        data["status"] = self.status.value
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, data: Any) -> FillSummary:
        if isinstance(data, dict) and "status" in data:
            try:
                data = {**data, "status": FillStatus(data["status"])}
            except ValueError:
                raise DocumentError(f"fill summary: status {data['status']!r} is not one of "
                                    f"{[s.value for s in FillStatus]}") from None
        if isinstance(data, dict):
            data = {**data, **{name: _records(kind, data[name], f"fill summary's {name}")
                               for name, kind in _SUMMARY_RECORDS.items()
                               if data.get(name) is not None}}
        return _from_dict(cls, data, "fill summary")

    @classmethod
    def from_json(cls, text: str) -> FillSummary:
        return cls.from_dict(_loads(text, "fill summary"))


_SUMMARY_RECORDS: dict[str, type] = {"lost": GroupMember, "bytes_by_peer": PeerBytes}
"""The summary's lists of typed records, by field."""


def _records(kind: type, items: Any, what: str) -> list[Any]:
    if not isinstance(items, list):
        raise DocumentError(f"{what} must be a list, got {type(items).__name__}")
    return [_from_dict(kind, item, what) for item in items]


def _loads(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise DocumentError(f"{what} is not JSON: {exc}") from None


def _from_dict(cls: type, data: Any, what: str) -> Any:
    if not isinstance(data, dict):
        raise DocumentError(f"{what} must be a JSON object, got {type(data).__name__}")
    known = {f.name for f in fields(cls)}
    required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
    missing = [name for name in required if name not in data]
    if missing:
        raise DocumentError(f"{what} lacks {', '.join(repr(m) for m in missing)}")
    # Unknown keys are ignored: a newer writer may add figures an older reader does not show.
    return cls(**{k: v for k, v in data.items() if k in known})
