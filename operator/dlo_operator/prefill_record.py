"""`status.prefill`: the record of one revision's prefill, typed.

Owns `PrefillState` and `PrefillRecord`, the record `prefill_stage` writes into `Decision.prefill`
and reads back from the previous status (`PrefillRecord.previous`), and its status spelling
(`to_status`, camelCase as the CRD's status shows it). The node rows inside it are
`status.prefill_node`'s. Pure; must not decide anything.
"""

from __future__ import annotations

import datetime
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any


class PrefillState(str, enum.Enum):
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    SUPERSEDED = "Superseded"
    """Ended unfinished: the spec no longer needs it (e.g. the model was reverted)."""


@dataclass(frozen=True, kw_only=True)
class PrefillRecord:
    """The prefill of one revision as `status.prefill` shows it."""

    revision: str
    state: PrefillState | None
    """None for a record this operator cannot read (written by another version)."""
    attempt: int
    entry_key: str = ""
    """The cache entry the prefill fills (`configmap.entry_key`): a settings edit that keeps it
    keeps the record's attempts and backoff. Empty in a record of an older operator."""
    nodes: tuple[Mapping[str, Any], ...] = ()
    """One row per prefill pod (`status.prefill_node`), by rank."""
    message: str = ""
    retry_at: datetime.datetime | None = None
    """When a failed prefill is tried again (the Backoff stage)."""

    @property
    def bytes_from_store(self) -> int:
        return sum(int(node.get("bytesFromStore", 0)) for node in self.nodes)

    @classmethod
    def previous(cls, status: Mapping[str, Any], revision: str) -> PrefillRecord | None:
        """The previous status's record when it is of `revision`, else None."""
        record = cls.read(status)
        return record if record is not None and record.revision == revision else None

    @classmethod
    def read(cls, status: Mapping[str, Any]) -> PrefillRecord | None:
        """The previous status's record, of whichever revision (None without one)."""
        if not status.get("revision"):
            return None
        state = status.get("state")
        return cls(revision=str(status["revision"]), attempt=int(status.get("attempt", 0)),
                   state=PrefillState(state) if state in _STATES else None,
                   entry_key=str(status.get("entryKey", "")),
                   nodes=tuple(status.get("nodes") or ()), message=str(status.get("message", "")),
                   retry_at=parse_time(status.get("retryAt")))

    def with_state(self, state: PrefillState, message: str, *,
                   retry_at: datetime.datetime | None = None) -> PrefillRecord:
        return replace(self, state=state, message=message, retry_at=retry_at)

    def to_status(self) -> dict[str, Any]:
        """The record as `status.prefill` spells it."""
        status = {"revision": self.revision,
                  "state": self.state.value if self.state is not None else None,
                  **({"entryKey": self.entry_key} if self.entry_key else {}),
                  "attempt": self.attempt, "nodes": [dict(node) for node in self.nodes],
                  "bytesFromStore": self.bytes_from_store, "message": self.message}
        if self.retry_at is not None:
            status["retryAt"] = format_time(self.retry_at)
        return status


def record_of(revision: str, entry_key: str, attempt: int,
              nodes: Sequence[Mapping[str, Any]]) -> PrefillRecord:
    """The record of an attempt whose Job exists, before its state is known."""
    return PrefillRecord(revision=revision, state=None, attempt=attempt, entry_key=entry_key,
                         nodes=tuple(nodes))


_STATES = {state.value for state in PrefillState}


def format_time(moment: datetime.datetime) -> str:
    return moment.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: Any) -> datetime.datetime | None:
    if not isinstance(text, str):
        return None
    try:
        return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(
            tzinfo=datetime.timezone.utc)
    except ValueError:
        return None
