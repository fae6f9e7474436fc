"""A fill group that loses a member once the exchange is over, while every rank's checks are
compared, with real `dlo cache fill` processes over gloo on loopback: every survivor holds every
chunk by then, so the survivors form their group, compare there, and publish the entry (a member
that holds the entry already finishes with them). The lost member is held just before it hands
its checks to the others (`support.loader_fleet.Hold`: its second `all_gather_object`, after the
plan's agreement), so the others wait for it in that comparison for certain."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from dlo_bench.faultproxy import FaultPlan
from dlo_bench.s3server import S3Server
from support.loader_fleet import Checkpoint, Fleet, Hold, ended, entry_files, finish, included
from test_loader_group import PATIENT, proxies
from test_loader_survive_holder import HOLDER, lost_mid_exchange

pytestmark = pytest.mark.slow
COMPARED = 2
"""The comparison of every rank's checks is a loader's second `all_gather_object`."""


def test_the_survivors_of_a_member_lost_while_the_checks_are_compared_publish(
    s3: S3Server, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    hold = Hold("all_gather_object", COMPARED, tmp_path / "held")
    with proxies(s3, *[FaultPlan()] * 3) as counting:
        fleet = Fleet(tmp_path, checkpoint.source, 3, [p.url for p in counting],
                      settings=PATIENT)
        outcomes = fleet.held_and_killed(2, hold)
    for outcome in outcomes:
        assert outcome.returncode == 0, outcome.stderr[-3000:]
        assert outcome.summary["without"] == [2]
        assert outcome.summary["bytes_read_again"] == 0
        assert "going on without loader rank 2 (pod loader-2, node node2): 0 chunk(s) move " \
            "again" in outcome.stderr
        assert entry_files(fleet.root(outcome.rank)) == included(checkpoint.files)


def test_a_member_that_holds_the_entry_finishes_with_the_survivors_of_a_late_loss(
    s3: S3Server, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    with proxies(s3, *[FaultPlan()] * 3) as counting:
        fleet = Fleet(tmp_path, checkpoint.source, 3, [p.url for p in counting])
        reader, holder = lost_mid_exchange(fleet, checkpoint, 2, Hold(
            "all_gather_object", COMPARED, tmp_path / "held"))
    for outcome in (reader, holder):
        assert outcome.returncode == 0, outcome.stderr[-3000:]
        assert outcome.summary["without"] == [2]
        assert "going on without loader rank 2 (pod loader-2, node node2): 0 chunk(s) move " \
            "again" in outcome.stderr
    assert holder.summary["cached"] is True
    assert entry_files(fleet.root(0)) == included(checkpoint.files)
    assert entry_files(fleet.root(HOLDER)) == included(checkpoint.files)


def test_a_member_lost_while_the_survivors_compare_their_checks_counts_too(
    s3: S3Server, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    """Rank 2 is lost mid-exchange; rank 1 then while the survivors compare their checks (its
    fourth `all_gather_object`: the plan's agreement, the survivors' holdings, their plan's
    agreement, the comparison): rank 0 publishes alone, without both."""
    with proxies(s3, *[FaultPlan()] * 3) as counting:
        fleet = Fleet(tmp_path, checkpoint.source, 3, [p.url for p in counting],
                      settings=PATIENT)
        holds = {1: Hold("all_gather_object", 4, tmp_path / "held-1"),
                 2: Hold("all_gather_into", 3, tmp_path / "held-2")}
        processes = {rank: fleet.start(rank, hold=holds.get(rank)) for rank in range(3)}
        with ended(*processes.values()):
            for rank in (2, 1):
                holds[rank].wait()
                os.kill(processes[rank].pid, signal.SIGKILL)
            [alone] = [finish(0, processes[0])]
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert sorted(alone.summary["without"]) == [1, 2]
    assert entry_files(fleet.root(0)) == included(checkpoint.files)
