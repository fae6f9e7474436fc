"""A fill group goes on through the losses `test_loader_survive` does not cover, with real
`dlo cache fill` processes over gloo on loopback: rank 0, whose store every member joined,
killed or stopped mid-fill (the others meet at rank 1's store, `group_stores`); a member lost
while the process group forms; a second member lost in the survivors' exchange. Every time the
survivors publish the entry a fill alone publishes, and their summaries name whom they finished
without."""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
import signal
from pathlib import Path

import pytest
from dlo_bench.faultproxy import FaultPlan
from dlo_bench.s3server import S3Server
from dlo_contract.cache import (
    CacheRoot,
    ObjectIdentity,
    begin_publication,
    checkpoint_identity,
    entry_id,
    locks,
)
from support.loader_fleet import (
    Checkpoint,
    Fleet,
    ended,
    finish,
    formed,
    included,
    published_as_alone,
    wait_until,
)
from test_loader_group import LOST, PATIENT, Watched, proxies, signalled_mid_fill

pytestmark = pytest.mark.slow
HELD = PATIENT | {"stall_timeout_s": 3600.0, "peer_timeout_s": 5.0}
"""`PATIENT`, but reads a test holds wait as long as the fill may (no store read gives up),
and a member waiting on its own held reads notices a loss within the heartbeat bound."""


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


def posted(port: int, key: str) -> bool:
    """Whether `key` is on the store of the group whose rank 0 listens on `port`."""
    import torch.distributed as dist

    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False,
                              timeout=datetime.timedelta(seconds=1))
        return bool(store.check([key]))
    except (RuntimeError, dist.DistError):
        return False


def test_the_survivors_of_a_member_lost_while_the_group_forms_publish_the_entry(
    s3: S3Server, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    """Members take their nodes' publications in node order (`claim`): the last node's is held
    here, so the others have posted their claims and wait for its one; one of them is killed
    then, and the lock let go. The others form the process group without it: it never comes,
    the heartbeat finds it lost, and they go on with the reads their exchange had started."""
    files = included(checkpoint.files)
    objects = [ObjectIdentity(k, len(v), hashlib.md5(v).hexdigest()) for k, v in files.items()]
    eid = entry_id(checkpoint_identity("s3://models/tiny/", objects))
    fleet = Fleet(tmp_path, checkpoint.source, 3, [s3.endpoint_url] * 3,
                  settings={"timeout_s": 3600.0, "peer_timeout_s": 10.0})
    roots = [CacheRoot(fleet.root(rank)) for rank in range(3)]
    for root in roots:
        root.ensure()
    order = sorted(range(3), key=lambda rank: locks.node_key(roots[rank].locks))
    last = order[-1]
    victim = max(rank for rank in order if rank != last)
    with contextlib.ExitStack() as stack:
        with begin_publication(fleet.root(last), eid, expected_bytes=0, lock_timeout_s=60):
            processes = {rank: fleet.start(rank) for rank in range(3)}
            stack.enter_context(ended(*processes.values()))
            wait_until(lambda: posted(fleet.master_port, f"dlo/claim/{victim}"))
            os.kill(processes[victim].pid, signal.SIGKILL)
        outcomes = [finish(rank, processes[rank]) for rank in range(3) if rank != victim]
    published_as_alone(fleet, outcomes, [victim], checkpoint, s3)
    for outcome in outcomes:
        assert "lost a member while it formed" in outcome.stderr
        assert f"going on without loader rank {victim}" in outcome.stderr


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_a_member_left_alone_by_two_losses_publishes_the_entry(
    signum: signal.Signals, s3: S3Server, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    """Rank 0 is killed mid-fill; once ranks 1 and 2 go on without it (rank 1 hosting their
    store), rank 1, which reads nothing from the store, is killed or stopped in their exchange:
    rank 2 goes on alone at its own store with what it holds, and publishes."""
    with proxies(s3, *[FaultPlan()] * 3) as held:
        held[0].reads_open.clear()
        held[1].reads_open.clear()
        fleet = Fleet(tmp_path, checkpoint.source, 3, [p.url for p in held], settings=HELD)
        loaders = [Watched(rank, fleet.start(rank)) for rank in range(3)]
        try:
            wait_until(lambda: formed(fleet.master_port) == 3 and held[0].object_requests >= 1)
            os.kill(loaders[0].process.pid, signal.SIGKILL)
            loaders[1].wait_for("going on without loader rank 0")
            os.kill(loaders[1].process.pid, signum)
            [outcome] = [loaders[2].finish()]
        finally:
            for loader in loaders[:2]:
                if loader.process.poll() is None:
                    os.kill(loader.process.pid, signal.SIGCONT)
                    loader.process.kill()
                loader.finish()
    published_as_alone(fleet, [outcome], [0, 1], checkpoint, s3)
    assert "going on without loader rank 1" in outcome.stderr
    assert "meeting at the store of loader rank 2" in outcome.stderr


def test_a_member_whose_two_peers_die_at_once_publishes_the_entry_alone(
    s3: S3Server, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    """Ranks 1 and 2 are killed together mid-fill: rank 0 drops the one its heartbeat names
    first, finds the other missing while their group of two forms, and goes on alone."""
    with proxies(s3, *[FaultPlan()] * 3) as held:
        held[1].reads_open.clear()
        held[2].reads_open.clear()
        fleet = Fleet(tmp_path, checkpoint.source, 3, [p.url for p in held], settings=HELD)
        processes = {rank: fleet.start(rank) for rank in range(3)}
        with ended(*processes.values()):
            wait_until(lambda: formed(fleet.master_port) == 3
                       and held[1].object_requests >= 1 and held[2].object_requests >= 1)
            for rank in (1, 2):
                os.kill(processes[rank].pid, signal.SIGKILL)
            outcome = finish(0, processes[0])
    published_as_alone(fleet, [outcome], [1, 2], checkpoint, s3)
    assert "the survivors lost another member while they formed their group" in outcome.stderr
