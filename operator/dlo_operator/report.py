"""Conditions and Events: the one helper the operator reports lifecycle outcomes through.

`set_condition` replaces one condition in a status's list (keeping its transition time while its
status stays), and `post_event` posts a Kubernetes Event on the DOD through kopf's event queue
(`Normal` for milestones, `Warning` for failures). Called by `reconcile`; pure except for the
Event post. Must not decide what happened (that is `rollout`).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import kopf


class EventType(str, enum.Enum):
    NORMAL = "Normal"
    WARNING = "Warning"


@dataclass(frozen=True, kw_only=True)
class Report:
    """One Event to post: what happened, why, in a line a person can act on."""

    type: EventType
    reason: str
    message: str


def set_condition(conditions: Sequence[Mapping[str, Any]], *, type: str, status: str,
                  reason: str, message: str, now: str) -> list[dict[str, Any]]:
    """`conditions` with the condition `type` replaced (or appended)."""
    old = next((c for c in conditions if c.get("type") == type), None)
    same = old is not None and old.get("status") == status
    new = {"type": type, "status": status, "reason": reason, "message": message,
           "lastTransitionTime": (old or {}).get("lastTransitionTime") if same else now}
    new["lastTransitionTime"] = new["lastTransitionTime"] or now
    return [dict(c) for c in conditions if c.get("type") != type] + [new]


def post_event(dod: Mapping[str, Any], report: Report) -> None:
    """Post `report` as an Event on the DOD (kopf batches and sends it)."""
    poster = kopf.warn if report.type is EventType.WARNING else kopf.info
    poster(dict(dod), reason=report.reason, message=report.message[:1024])
