"""A fill group goes on through the losses `test_loader_survive` does not cover, with real
`dlo cache fill` processes over gloo on loopback: rank 0, whose store every member joined,
killed or stopped mid-fill (the others meet at rank 1's store, `group_stores`); a member lost
while the process group forms; a second member lost in the survivors' exchange. Every time the
survivors publish the entry a fill alone publishes, and their summaries name whom they finished
without."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from dlo_bench.faultproxy import FaultPlan
from dlo_bench.s3server import S3Server
from support.loader_fleet import Checkpoint, Fleet, Outcome, entry_files, included
from test_loader_group import LOST, proxies, signalled_mid_fill

pytestmark = pytest.mark.slow


def published_as_alone(fleet: Fleet, outcomes: list[Outcome], without: list[int],
                       checkpoint: Checkpoint, s3: S3Server) -> None:
    """Every survivor published what a fill alone publishes, naming the members it lost."""
    alone = Fleet(fleet.tmp / "alone", checkpoint.source, 1, [s3.endpoint_url])
    [single] = alone.run()
    assert single.returncode == 0, single.stderr
    for outcome in outcomes:
        assert outcome.returncode == 0, outcome.stderr[-3000:]
        assert outcome.summary["status"] == "ok" and outcome.summary["without"] == without
        assert entry_files(fleet.root(outcome.rank)) == included(checkpoint.files)
        assert entry_files(fleet.root(outcome.rank)) == entry_files(alone.root(0))
    for rank in without:
        entries = fleet.root(rank) / "v1" / "entries"
        assert not entries.exists() or not any(entries.iterdir())


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_the_survivors_of_rank_zero_publish_the_entry_at_rank_ones_store(
    signum: signal.Signals, s3: S3Server, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    # Rank 0's reads are held: the others wait for its chunks when it is lost.
    with proxies(s3, *[FaultPlan()] * 3) as held:
        held[0].reads_open.clear()
        fleet = Fleet(tmp_path, checkpoint.source, 3, [p.url for p in held])
        outcomes = signalled_mid_fill(fleet, held, 0, signum)
    published_as_alone(fleet, outcomes, [0], checkpoint, s3)
    how = LOST["host died"] if signum == signal.SIGKILL else LOST["store"]
    for outcome in outcomes:
        assert f"loader rank 0 (pod {Fleet.pod(0)}, node {Fleet.node(0)}) {how}" in \
            outcome.stderr
        assert "meeting at the store of loader rank 1" in outcome.stderr
        assert "going on without loader rank 0" in outcome.stderr
