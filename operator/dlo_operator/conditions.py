"""Conditions and Warning Events: how a failure of the operator becomes visible to `kubectl`.

Every failure the operator meets (a refused spec, an API refusal while applying a child, a fill
or a container in trouble) is a `Condition` with status False, a one-word reason and a message,
written into `status.conditions` and posted once as a Warning Event on the DOD. Any part of the
operator reports through `report_event` and `merge_conditions`, whatever condition type it owns;
conditions of types it does not recompute are kept as they are.

Milestones of the rollout (a prefill started, succeeded, failed) are `Report`s, posted by
`post_event` as Normal or Warning Events. `merge_conditions` is pure; `report_event` and
`post_event` post through kopf's event queue.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

TRUE = "True"
FALSE = "False"
_MESSAGE_LIMIT = 1024


@dataclass(frozen=True)
class Condition:
    """One entry of `status.conditions` before it is stamped with times and a generation."""

    type: str
    status: str
    reason: str
    message: str

    @property
    def failed(self) -> bool:
        return self.status == FALSE

    @classmethod
    def from_status(cls, entry: Mapping[str, Any]) -> Condition:
        return cls(type=str(entry.get("type", "")), status=str(entry.get("status", "")),
                   reason=str(entry.get("reason", "")), message=str(entry.get("message", "")))


def find(status: Mapping[str, Any] | None, kind: str) -> Condition | None:
    """The condition `kind` of a status written before, if any."""
    for entry in (status or {}).get("conditions") or ():
        if entry.get("type") == kind:
            return Condition.from_status(entry)
    return None


def merge_conditions(previous: Sequence[Mapping[str, Any]] | None, current: Sequence[Condition], *,
                     generation: int | None, now: str) -> list[dict[str, Any]]:
    """`current` stamped with `observedGeneration` and a `lastTransitionTime` that moves only
    when the status changes; previous conditions of other types follow, unchanged."""
    old = {entry.get("type"): entry for entry in previous or ()}
    merged = []
    for condition in current:
        before = old.get(condition.type)
        same = before is not None and before.get("status") == condition.status
        entry: dict[str, Any] = {
            "type": condition.type, "status": condition.status, "reason": condition.reason,
            "message": condition.message[:_MESSAGE_LIMIT],
            "lastTransitionTime": (before.get("lastTransitionTime") if same and before else None)
            or now,
        }
        if generation is not None:
            entry["observedGeneration"] = generation
        merged.append(entry)
    types = {c.type for c in current}
    merged += [dict(entry) for entry in previous or () if entry.get("type") not in types]
    return merged


class EventType(str, enum.Enum):
    NORMAL = "Normal"
    WARNING = "Warning"


@dataclass(frozen=True, kw_only=True)
class Report:
    """One Event to post: what happened, why, in a line a person can act on."""

    type: EventType
    reason: str
    message: str


def report_event(body: Mapping[str, Any], condition: Condition) -> None:
    """A Warning Event on the DOD for a failed condition (reason and message as in the status);
    a Normal Event for anything else."""
    post_event(body, Report(type=EventType.WARNING if condition.failed else EventType.NORMAL,
                            reason=condition.reason, message=condition.message))


def post_event(body: Mapping[str, Any], report: Report) -> None:
    """Post `report` as an Event on the DOD; kopf posts it in the background and retries."""
    import kopf

    poster = kopf.warn if report.type is EventType.WARNING else kopf.info
    poster(dict(body), reason=report.reason, message=report.message[:_MESSAGE_LIMIT])
