"""A fill group that loses a member mid-fill goes on without it (`survive`), with real
`dlo cache fill` processes over gloo on loopback: a member killed, or stopped, while the others
wait for its chunks; the others publish the entry a fill alone publishes, and their summaries
say whom they finished without and what they read again."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from dlo_bench.faultproxy import FaultPlan
from dlo_bench.s3server import S3Server
from support.loader_fleet import (Checkpoint, Fleet, ended, finish, formed, included,
                                  published_as_alone, wait_until)
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
    published_as_alone(fleet, outcomes, [2], checkpoint, s3)
    for outcome in outcomes:
        assert outcome.summary["lost"] == [
            {"rank": 2, "pod": fleet.pod(2), "node": fleet.node(2)}]
        assert "going on without loader rank 2" in outcome.stderr
    # Each survivor keeps every chunk it read whole, its own chunk of the round the loss cut
    # short too (`Exchange.settle`): the survivors read the model from the store once in all.
    assert 0 < read_again < sum(store_bytes)
    assert sum(store_bytes) == sum(map(len, included(checkpoint.files).values()))


def test_a_killed_member_is_found_by_its_closed_port_not_by_the_heartbeat_bound(
    s3: S3Server, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    """A member killed on a node that stays up is lost as soon as a collective fails (its
    store's port refuses connections: [Note: a closed connection] in `peers`): with a heartbeat
    bound past the process guard, only that can let the survivors finish."""
    with proxies(s3, *[FaultPlan()] * 3) as held:
        held[2].reads_open.clear()
        fleet = Fleet(tmp_path, checkpoint.source, 3, [p.url for p in held],
                      settings={"timeout_s": 3600.0, "peer_timeout_s": 3600.0})
        processes = {rank: fleet.start(rank) for rank in range(3)}
        with ended(*processes.values()):
            wait_until(lambda: formed(fleet.master_port) == 3 and held[2].object_requests >= 1)
            os.kill(processes[2].pid, signal.SIGKILL)
            outcomes = [finish(rank, processes[rank]) for rank in (0, 1)]
    published_as_alone(fleet, outcomes, [2], checkpoint, s3)
    # The survivor that found it says how; the other adopts its verdict.
    assert any("loader rank 2 (pod loader-2, node node2) died: its connections to the group "
               "closed and its process is gone" in outcome.stderr for outcome in outcomes)
