"""Several fill groups of one model on the same nodes (two DODs, or prefill Jobs), real
`dlo cache fill` processes started crosswise: every loader ends ok in about one fill's time,
with `onRendezvousTimeout: fail` and a rendezvous timeout far above the fill's, and the store
serves about one model's bytes in all (see [Note: node order] in `dlo_loader.claim`).

Each group's first loaders start, and get as far as waiting for their group (the point where a
loader used to hold its node's publication), before the rest start: in the order that used to
close a cycle of waits until the rendezvous timeout."""

from __future__ import annotations

import os
import select
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from dlo_bench.faultproxy import FaultPlan, FaultProxy
from dlo_bench.s3server import S3Server
from support.loader_fleet import Checkpoint, Fleet, entry_files, finish, included

pytestmark = pytest.mark.slow
RENDEZVOUS_TIMEOUT_S = 600.0
"""Far above a fill's few seconds: a loader that waited for it would show in its summary."""
SETTINGS = {"on_rendezvous_timeout": "fail", "rendezvous_timeout_s": RENDEZVOUS_TIMEOUT_S,
            "timeout_s": 300.0}


@dataclass
class _Group(Fleet):
    """A fill group whose rank r runs on node `nodes[r]` of a cluster shared with others."""

    nodes: tuple[int, ...] = ()
    cluster: Path = Path()

    def root(self, rank: int) -> Path:
        return self.cluster / f"node{self.nodes[rank]}" / "cache"


def _waiting_for_group(process: subprocess.Popen[str], timeout_s: float = 120.0) -> None:
    """Until the loader says it waits for its group (a hang guard, not a timing assertion)."""
    assert process.stdout is not None
    fd, seen = process.stdout.fileno(), b""
    deadline = time.monotonic() + timeout_s
    while b"waiting for " not in seen:
        ready, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0))
        if not ready:
            raise AssertionError(f"the loader never waited for its group: {seen!r}")
        chunk = os.read(fd, 4096)
        if not chunk:
            raise AssertionError(f"the loader ended before its group: {seen!r}")
        seen += chunk


def _run_crosswise(groups: list[_Group], first: list[tuple[int, int]]) -> list[dict]:
    """Start the (group, rank) pairs of `first`, wait until each waits for its group, then
    start every other loader; the summaries of all."""
    started = {(g, r): groups[g].start(r) for g, r in first}
    for g, r in first:
        _waiting_for_group(started[g, r])
    for g, group in enumerate(groups):
        for rank in range(group.world):
            if (g, rank) not in started:
                started[g, rank] = group.start(rank)
    outcomes = {key: finish(key[1], process) for key, process in started.items()}
    for (g, rank), outcome in sorted(outcomes.items()):
        assert outcome.returncode == 0, (g, rank, outcome.stderr)
    return [outcome.summary for _, outcome in sorted(outcomes.items())]


TOPOLOGIES = {
    # Two DODs on the same two nodes; group one's rank 0 and group two's rank 1 first.
    "two-groups-crosswise": ([(0, 1), (0, 1)], [(0, 0), (1, 1)]),
    # The same, the other way round: group one's rank 1 and group two's rank 0 first.
    "two-groups-crosswise-reversed": ([(0, 1), (0, 1)], [(0, 1), (1, 0)]),
    # Two DODs whose ranks sit on the nodes the other way round.
    "two-groups-swapped-ranks": ([(0, 1), (1, 0)], [(0, 0), (1, 0)]),
    # Three groups, each on two of three nodes (a ring), each first on its second node.
    "three-groups-ring": ([(0, 1), (1, 2), (2, 0)], [(0, 1), (1, 1), (2, 1)]),
    # Three groups on all three nodes, each first on a different node.
    "three-groups-three-nodes": ([(0, 1, 2)] * 3, [(0, 2), (1, 1), (2, 0)]),
}


@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
def test_groups_sharing_nodes_fill_once_without_waiting_out_the_rendezvous(
        topology: str, s3: S3Server, checkpoint: Checkpoint, tmp_path: Path) -> None:
    placements, first = TOPOLOGIES[topology]
    model = sum(map(len, included(checkpoint.files).values()))
    with FaultProxy(s3.endpoint_url, FaultPlan()) as counting:  # every store read, counted
        groups = [_Group(tmp_path / f"group{g}", checkpoint.source, len(nodes),
                         [counting.url] * len(nodes), settings=SETTINGS, nodes=nodes,
                         cluster=tmp_path / "cluster")
                  for g, nodes in enumerate(placements)]
        summaries = _run_crosswise(groups, first)
        store_bytes = counting.object_bytes
    waits = [summary["wait_seconds"] for summary in summaries]
    print(f"\n{topology}: store bytes {store_bytes / model:.3f}x the model; longest waits "
          f"(s): {max(w['group'] for w in waits):.2f} for a group, "
          f"{max(w['turn'] + w['publication'] for w in waits):.2f} for a node's publication; "
          f"fills published: {sum(not s['cached'] for s in summaries)} of {len(summaries)}")
    assert store_bytes <= 1.1 * model, (store_bytes, model)
    assert sum(summary["bytes_from_store"] for summary in summaries) == store_bytes
    # Each loader says how long it waited for its group and for other publications; none came
    # near the rendezvous timeout (what used to end the crosswise start).
    assert all(w["group"] < RENDEZVOUS_TIMEOUT_S / 10 for w in waits), waits
    assert all(w["turn"] + w["publication"] < RENDEZVOUS_TIMEOUT_S / 10 for w in waits), waits
    nodes = {node for placement in placements for node in placement}
    for node in nodes:
        assert entry_files(tmp_path / "cluster" / f"node{node}" / "cache") == included(
            checkpoint.files)
