"""What a loader's fill summary tells the DOD: the figures of its node's status row, and Events.

`figures(summary)` gives the figures a node's row carries (`status.nodes[]`, and
`status.prefill.nodes[]` for a prefill loader) under their status names: the bytes from the
store and from peers, the members of its group the fill finished without (`filledWithout`) and
what it read again for them (`bytesReadAgain`), and, for a node refilled from the nodes that
hold its entry, the bytes each of them served (`bytesByPeer`). `fill_events(row)` words the
Events of one such row: `FilledWithoutMember` (Warning: its group lost members mid-fill and
finished without them; their nodes fill later, when their loaders run again) and
`RefilledFromPeers` (Normal). Pure; the handlers post the Events of a sidecar loader once, when
they keep its summary (`summary_events`, `progress.published_without_summary`). A prefill
loader's row carries the figures alone: a prefill Job whose pod failed fails as a whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dlo_contract.documents import DocumentError, FillSummary
from dlo_contract.units import human_bytes
from dlo_operator.conditions import EventType, Report

REFILLED_FROM_PEERS = "RefilledFromPeers"
FILLED_WITHOUT_MEMBER = "FilledWithoutMember"


def figures(summary: FillSummary | None) -> dict[str, Any]:
    """The loader summary's figures under their status names (absent ones left out)."""
    if summary is None:
        return {}
    found = {"entryId": summary.entry_id, "mode": summary.mode,
             "bytesFromStore": summary.bytes_from_store,
             "bytesFromPeers": summary.bytes_from_peers, "seconds": summary.seconds,
             "cached": summary.cached, "filledWithout": _without(summary),
             "bytesReadAgain": summary.bytes_read_again,
             "bytesByPeer": [{"node": p.node, "bytes": p.bytes}
                             for p in summary.bytes_by_peer or ()] or None}
    return {name: value for name, value in found.items() if value is not None}


def _without(summary: FillSummary) -> list[dict[str, Any]] | None:
    """The members the fill finished without: rank, and pod and node where the group knew
    them (a summary without `lost` names their ranks alone)."""
    members = ([{"rank": m.rank, "pod": m.pod, "node": m.node} for m in summary.lost]
               if summary.lost else [{"rank": rank} for rank in summary.without or ()])
    return [{k: v for k, v in m.items() if v != ""} for m in members] or None


def summary_events(pod: Mapping[str, Any], line: str) -> list[Report]:
    """The Events of the fill summary `line` of `pod`'s loader (none for one not readable)."""
    try:
        summary = FillSummary.from_json(line)
    except DocumentError:
        return []
    return fill_events({"pod": (pod.get("metadata") or {}).get("name", ""),
                        "node": (pod.get("spec") or {}).get("nodeName", ""), **figures(summary)})


def fill_events(row: Mapping[str, Any]) -> list[Report]:
    """The Events one node's row calls for (`figures` under `pod` and `node`): none for a fill
    from the store or a group that kept every member."""
    reports = []
    if row.get("filledWithout"):
        reports.append(_without_report(row))
    if row.get("bytesByPeer") and not row.get("cached"):
        reports.append(_refill_report(row))
    return reports


def _without_report(row: Mapping[str, Any]) -> Report:
    lost = row["filledWithout"]
    them = "it" if len(lost) == 1 else "them"
    return Report(type=EventType.WARNING, reason=FILLED_WITHOUT_MEMBER, message=(
        f"pod {_where(row)} finished its group's fill without "
        f"{', '.join(_member(m) for m in lost)}, lost mid-fill: it read "
        f"{human_bytes(row.get('bytesReadAgain') or 0)} again from the store for {them} "
        f"({human_bytes(row.get('bytesFromStore') or 0)} from the store in all); "
        f"{_later(lost)}"))


def _later(lost: list[Mapping[str, Any]]) -> str:
    """Whose node fills later: the lost members' nodes, by name where the group knew them
    (from the nodes that hold the entry where they serve it, else from the store)."""
    nodes = [m["node"] for m in lost if m.get("node")]
    one = len(lost) == 1
    whose = (f"node{'' if len(nodes) == 1 else 's'} {', '.join(nodes)}" if nodes
             else "its node" if one else "their nodes")
    return (f"{whose} fills later, when its loader runs again" if one
            else f"{whose} fill later, when their loaders run again")


def _refill_report(row: Mapping[str, Any]) -> Report:
    peers = row["bytesByPeer"]
    listed = sum(int(p["bytes"]) for p in peers)
    each = [f"{p['node']} {human_bytes(int(p['bytes']))}" for p in peers]
    rest = int(row.get("bytesFromPeers") or 0) - listed
    if rest > 0:
        each.append(f"other peers {human_bytes(rest)}")
    return Report(type=EventType.NORMAL, reason=REFILLED_FROM_PEERS, message=(
        f"pod {row.get('pod') or '?'} refilled node {row.get('node') or '?'} from the nodes "
        f"that hold its entry: {human_bytes(int(row.get('bytesFromPeers') or listed))} from "
        f"peers ({', '.join(each)}), {human_bytes(row.get('bytesFromStore') or 0)} from the "
        "store"))


def _where(row: Mapping[str, Any]) -> str:
    node = row.get("node")
    return f"{row.get('pod') or '?'}" + (f" (node {node})" if node else "")


def _member(member: Mapping[str, Any]) -> str:
    """A lost member as the loader's own messages name it (`dlo_loader.members.Member`)."""
    where = [f"pod {member['pod']}"] if member.get("pod") else []
    where += [f"node {member['node']}"] if member.get("node") else []
    return f"loader rank {member['rank']}" + (f" ({', '.join(where)})" if where else "")
