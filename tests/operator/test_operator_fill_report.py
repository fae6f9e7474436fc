"""`fill_report`: a loader summary's figures in its node's status row, and the Events of a fill
that finished without members of its group or refilled a node from the nodes that hold its
entry, with the bytes from each."""

from __future__ import annotations

import json
from typing import Any

from dlo_contract.documents import FillSummary
from dlo_operator.conditions import EventType
from dlo_operator.fill_report import (
    FILLED_WITHOUT_MEMBER,
    REFILLED_FROM_PEERS,
    figures,
    fill_events,
    summary_events,
)
from dlo_operator.status import node_entry, prefill_node

MIB = 1 << 20
FULL = {"status": "ok", "entry_id": "ab" * 32, "mode": "multi-reader", "rank": 0,
        "world_size": 3, "bytes_from_store": 40 * MIB, "bytes_from_peers": 80 * MIB,
        "bytes_to_peers": 80 * MIB, "seconds": 12.5, "cached": False, "store_checksums": "all",
        "stage_seconds": {"get": 10.125, "digest": 1.25, "write": 2.5, "exchange": 3.75},
        "wait_seconds": {"group": 0.5, "turn": 0.0, "publication": 0.0, "room": 0.0}}
SURVIVOR = FULL | {"without": [2], "bytes_read_again": 8 * MIB,
                   "lost": [{"rank": 2, "pod": "flux-2", "node": "gpu-2"}]}
REFILL = FULL | {"rank": 0, "world_size": 1, "bytes_from_store": 0, "bytes_to_peers": 0,
                 "bytes_from_peers": 120 * MIB, "bytes_by_peer": [
                     {"node": "gpu-0", "bytes": 80 * MIB}, {"node": "gpu-1", "bytes": 40 * MIB}]}


def row(summary: dict[str, Any], pod: str = "flux-0", node: str = "gpu-0") -> dict[str, Any]:
    return {"pod": pod, "node": node, **figures(FillSummary.from_dict(summary))}


def test_a_survivor_s_row_names_the_members_lost_and_what_it_read_again() -> None:
    found = figures(FillSummary.from_dict(SURVIVOR))
    assert found["filledWithout"] == [{"rank": 2, "pod": "flux-2", "node": "gpu-2"}]
    assert found["bytesReadAgain"] == 8 * MIB and "bytesByPeer" not in found


def test_a_summary_that_names_ranks_alone_gives_the_ranks() -> None:
    older = {k: v for k, v in SURVIVOR.items() if k != "lost"}
    assert figures(FillSummary.from_dict(older))["filledWithout"] == [{"rank": 2}]


def test_a_refilled_row_gives_the_bytes_each_holder_served() -> None:
    found = figures(FillSummary.from_dict(REFILL))
    assert found["bytesByPeer"] == [{"node": "gpu-0", "bytes": 80 * MIB},
                                    {"node": "gpu-1", "bytes": 40 * MIB}]
    assert "filledWithout" not in found and "bytesReadAgain" not in found


def test_a_survivor_gets_a_warning_naming_the_lost_member_and_its_node_that_fills_later() -> None:
    [report] = fill_events(row(SURVIVOR))
    assert (report.type, report.reason) == (EventType.WARNING, FILLED_WITHOUT_MEMBER)
    assert report.message == (
        "pod flux-0 (node gpu-0) finished its group's fill without loader rank 2 (pod flux-2, "
        "node gpu-2), lost mid-fill: it read 8.0 MiB again from the store for it (40.0 MiB "
        "from the store in all); node gpu-2 fills later, when its loader runs again")


def test_members_lost_whose_nodes_are_unknown_are_named_by_rank() -> None:
    two = SURVIVOR | {"without": [2, 3], "lost": None}
    [report] = fill_events(row(two))
    assert report.message == (
        "pod flux-0 (node gpu-0) finished its group's fill without loader rank 2, loader rank "
        "3, lost mid-fill: it read 8.0 MiB again from the store for them (40.0 MiB from the "
        "store in all); their nodes fill later, when their loaders run again")


def test_members_lost_on_named_nodes_name_each_node() -> None:
    two = SURVIVOR | {"without": [2, 3], "lost": [
        {"rank": 2, "pod": "flux-2", "node": "gpu-2"},
        {"rank": 3, "pod": "flux-3", "node": "gpu-3"}]}
    [report] = fill_events(row(two))
    assert report.message.endswith(
        "nodes gpu-2, gpu-3 fill later, when their loaders run again")


def test_a_refill_gets_a_normal_event_with_the_bytes_from_each_peer() -> None:
    [report] = fill_events(row(REFILL, "flux-2", "gpu-2"))
    assert (report.type, report.reason) == (EventType.NORMAL, REFILLED_FROM_PEERS)
    assert report.message == (
        "pod flux-2 refilled node gpu-2 from the nodes that hold its entry: 120.0 MiB from "
        "peers (gpu-0 80.0 MiB, gpu-1 40.0 MiB), 0 B from the store")


def test_holders_past_those_listed_are_summed() -> None:
    more = REFILL | {"bytes_from_peers": 130 * MIB, "bytes_from_store": 2 * MIB}
    [report] = fill_events(row(more, "flux-2", "gpu-2"))
    assert report.message.endswith(
        "130.0 MiB from peers (gpu-0 80.0 MiB, gpu-1 40.0 MiB, other peers 10.0 MiB), "
        "2.0 MiB from the store")


def test_fills_from_the_store_a_whole_group_or_a_cached_entry_call_for_no_event() -> None:
    assert fill_events(row(FULL)) == []
    assert fill_events(row(REFILL | {"cached": True})) == []
    assert summary_events({"metadata": {"name": "flux-0"}}, "not a summary") == []


def test_summary_events_read_the_pod_s_name_and_node() -> None:
    pod = {"metadata": {"name": "flux-1"}, "spec": {"nodeName": "gpu-1"}}
    [report] = summary_events(pod, json.dumps(SURVIVOR))
    assert report.message.startswith("pod flux-1 (node gpu-1) finished its group's fill")


def test_a_summary_longer_than_an_error_line_still_fills_the_status_row() -> None:
    """A survivor's summary runs past the 512 characters an error message is cut to."""
    message = json.dumps(SURVIVOR)
    assert len(message) > 512
    terminated = {"name": "loader", "state": {"terminated": {"exitCode": 0, "message": message}}}
    meta = {"name": "flux-0", "labels": {"apps.kubernetes.io/pod-index": "0",
                                         "batch.kubernetes.io/job-completion-index": "0"}}
    workload = node_entry({"metadata": meta, "spec": {"nodeName": "gpu-0"},
                           "status": {"initContainerStatuses": [terminated]}})
    prefill = prefill_node({"metadata": meta, "spec": {"nodeName": "gpu-0"},
                            "status": {"containerStatuses": [terminated]}})
    for found in (workload, prefill):
        assert found["filledWithout"] == [{"rank": 2, "pod": "flux-2", "node": "gpu-2"}]
        assert found["bytesReadAgain"] == 8 * MIB
