"""A fill group that loses a member mid-fill goes on without it (`survive`), with real
`dlo cache fill` processes over gloo on loopback: a member killed, or stopped, while the others
wait for its chunks; the others publish the entry a fill alone publishes, and their summaries
say whom they finished without and what they read again."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from dlo_bench.faultproxy import FaultPlan
from dlo_bench.s3server import S3Server
from support.loader_fleet import Checkpoint, Fleet, entry_files, included, no_entry
from test_loader_group import proxies, signalled_mid_fill

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_the_survivors_of_a_lost_member_publish_the_entry_without_it(
    signum: signal.Signals, s3: S3Server, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    # Rank 2's reads are held: the others wait for its chunks when it is lost, and none of
    # them holds the chunks it owns, so they read those again from the store.
    with proxies(s3, *[FaultPlan()] * 3) as held:
        held[2].reads_open.clear()
        fleet = Fleet(tmp_path, checkpoint.source, 3, [p.url for p in held])
        outcomes = signalled_mid_fill(fleet, held, 2, signum)
        for outcome in outcomes:
            assert outcome.returncode == 0, outcome.stderr[-3000:]
        read_again = sum(outcome.summary["bytes_read_again"] for outcome in outcomes)
        store_bytes = [held[rank].object_bytes for rank in (0, 1)]
    alone = Fleet(tmp_path / "alone", checkpoint.source, 1, [s3.endpoint_url])
    [single] = alone.run()
    assert single.returncode == 0, single.stderr
    for outcome in outcomes:
        assert outcome.returncode == 0, outcome.stderr
        assert outcome.summary["status"] == "ok" and outcome.summary["without"] == [2]
        assert outcome.summary["lost"] == [
            {"rank": 2, "pod": fleet.pod(2), "node": fleet.node(2)}]
        assert entry_files(fleet.root(outcome.rank)) == included(checkpoint.files)
        assert entry_files(fleet.root(outcome.rank)) == entry_files(alone.root(0))
        assert "going on without loader rank 2" in outcome.stderr
    assert read_again > 0
    assert sum(store_bytes) >= sum(map(len, included(checkpoint.files).values()))
    assert no_entry(fleet.root(2)) or not any((fleet.root(2) / "v1" / "entries").iterdir())
