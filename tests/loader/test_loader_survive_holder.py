"""A fill group with a member whose node holds the entry already (it serves the chunks from its
entry and publishes nothing) loses a member mid-exchange, with real `dlo cache fill` processes
over gloo on loopback: the holder goes on with the other survivors and serves what they miss
from its entry, nothing read again from the store; and when the holder is the one lost, the
others read what it never sent from the store. The lost member is held at its third chunk round
(`support.loader_fleet.Hold`), so the loss lands mid-exchange for certain."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import subprocess
from pathlib import Path

import pytest
from dlo_bench.faultproxy import FaultPlan
from dlo_bench.s3server import S3Server
from dlo_contract.cache import ObjectIdentity, begin_publication, checkpoint_identity, entry_id
from support.loader_fleet import (
    Checkpoint,
    Fleet,
    Hold,
    OpenWatch,
    Outcome,
    ended,
    entry_files,
    finish,
    included,
    no_entry,
)
from test_loader_group import PATIENT, _publish_copy, proxies

pytestmark = pytest.mark.slow
HOLDER = 1
"""The rank whose node holds the entry: it finds it once the publication it waited for is done
(rank 0 hosts the group's store, whose loss no group survives)."""


def entry_of(checkpoint: Checkpoint) -> tuple[dict[str, bytes], list[ObjectIdentity], str]:
    """The included files, their identities and the entry id of the test checkpoint."""
    files = included(checkpoint.files)
    objects = [ObjectIdentity(k, len(v), hashlib.md5(v).hexdigest()) for k, v in files.items()]
    return files, objects, entry_id(checkpoint_identity("s3://models/tiny/", objects))


def lost_mid_exchange(fleet: Fleet, checkpoint: Checkpoint, victim: int, hold: Hold,
                      ) -> list[Outcome]:
    """Start three loaders, rank `HOLDER` finding the entry the test publishes while it waits
    for its lock; `victim` stops at `hold` and is SIGKILLed there. The others' outcomes."""
    files, objects, eid = entry_of(checkpoint)
    fleet.settings |= PATIENT
    root = fleet.root(HOLDER)
    processes: dict[int, subprocess.Popen[str]] = {}
    with contextlib.ExitStack() as stack:
        with begin_publication(root, eid, expected_bytes=0, lock_timeout_s=60) as pub:
            watch = OpenWatch(root / "v1" / "locks" / f"{eid}.publish")
            processes.update({rank: fleet.start(rank, hold=hold if rank == victim else None)
                              for rank in range(fleet.world)})
            stack.enter_context(ended(*processes.values()))
            watch.wait()  # the holder found no entry and now waits for this publication's lock
            watch.close()
            _publish_copy(pub, files, objects)
        hold.wait()
        os.kill(processes[victim].pid, signal.SIGKILL)
        return [finish(rank, processes[rank]) for rank in processes if rank != victim]


def test_a_member_that_holds_the_entry_goes_on_and_serves_what_the_others_miss(
    s3: S3Server, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    with proxies(s3, *[FaultPlan()] * 3) as counting:
        fleet = Fleet(tmp_path, checkpoint.source, 3, [p.url for p in counting])
        reader, holder = lost_mid_exchange(fleet, checkpoint, 2, Hold(
            "all_gather_into", 3, tmp_path / "held"))
        store_bytes = [p.object_bytes for p in counting]
    for outcome in (reader, holder):
        assert outcome.returncode == 0, outcome.stderr[-3000:]
        assert outcome.summary["without"] == [2]
        assert "going on without loader rank 2" in outcome.stderr
        assert outcome.summary["bytes_read_again"] == 0  # the holder holds every chunk
    assert holder.summary["cached"] is True and reader.summary["cached"] is False
    assert store_bytes == [0, 0, 0]  # only the holder reads, from its entry
    assert entry_files(fleet.root(0)) == included(checkpoint.files)
    assert entry_files(fleet.root(HOLDER)) == included(checkpoint.files)
    assert no_entry(fleet.root(2)) or not any((fleet.root(2) / "v1" / "entries").iterdir())


def test_when_the_member_that_holds_the_entry_is_lost_the_others_read_its_share_again(
    s3: S3Server, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    with proxies(s3, *[FaultPlan()] * 3) as counting:
        fleet = Fleet(tmp_path, checkpoint.source, 3, [p.url for p in counting])
        outcomes = lost_mid_exchange(fleet, checkpoint, HOLDER, Hold(
            "all_gather_into", 3, tmp_path / "held"))
        store_bytes = [p.object_bytes for p in counting]
    read_again = 0
    for outcome in outcomes:
        assert outcome.returncode == 0, outcome.stderr[-3000:]
        assert outcome.summary["without"] == [HOLDER]
        assert entry_files(fleet.root(outcome.rank)) == included(checkpoint.files)
        assert outcome.summary["bytes_from_store"] == store_bytes[outcome.rank]
        read_again += outcome.summary["bytes_read_again"]
    # What the holder never sent (all but its first rounds) comes from the store, once.
    assert 0 < read_again == sum(store_bytes) < sum(map(len, included(checkpoint.files).values()))


def test_where_every_node_holds_the_entry_a_member_lost_costs_the_others_nothing(
    s3: S3Server, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    files, objects, eid = entry_of(checkpoint)
    hold = Hold("all_gather_object", 1, tmp_path / "held")  # the plan's agreement
    with proxies(s3, *[FaultPlan()] * 3) as counting:
        fleet = Fleet(tmp_path, checkpoint.source, 3, [p.url for p in counting],
                      settings=PATIENT)
        for rank in range(3):
            with begin_publication(fleet.root(rank), eid, expected_bytes=0,
                                   lock_timeout_s=60) as pub:
                _publish_copy(pub, files, objects)
        outcomes = fleet.held_and_killed(2, hold)
        assert [p.object_bytes for p in counting] == [0, 0, 0]
    for outcome in outcomes:
        assert outcome.returncode == 0, outcome.stderr[-3000:]
        assert outcome.summary["cached"] is True
        # Rank 1 may find rank 0 gone first: it finished, and its store with it.
        assert "was lost while the group agreed on the plan" in outcome.stderr
        assert entry_files(fleet.root(outcome.rank)) == files
