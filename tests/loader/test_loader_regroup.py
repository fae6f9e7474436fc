"""Survivors of a loader group form a group again (`regroup`), with real processes over gloo on
loopback: a member killed or stopped while the others wait for it in a collective; the others
agree it is gone, form a group of two and run every kind of collective in it; a stopped member
that comes back finds it was dropped and fails saying so."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from dlo_bench.s3server import free_port

from support.loader_fleet import CHECKOUT, checkout_env

PEER_TIMEOUT_S = 2.0
HANG_GUARD_S = 90.0


def line_of(process: subprocess.Popen[str]) -> dict[str, Any]:
    """The next JSON line `process` prints (a hang guard bounds the wait)."""
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], HANG_GUARD_S)
    assert ready, f"pid {process.pid} printed nothing"
    line = process.stdout.readline()
    assert line, f"pid {process.pid} ended: {process.wait()}"
    return json.loads(line)


@contextmanager
def members(victim: int) -> Iterator[dict[int, subprocess.Popen[str]]]:
    port = free_port()
    processes = {rank: subprocess.Popen(
        [sys.executable, str(CHECKOUT / "tests" / "support" / "regroup_member.py"), str(rank),
         str(port), str(victim), str(PEER_TIMEOUT_S)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=checkout_env())
        for rank in range(3)}
    try:
        for process in processes.values():
            assert line_of(process) == {"formed": True}
        yield processes
    finally:
        for process in processes.values():
            if process.poll() is None:
                os.kill(process.pid, signal.SIGCONT)
                process.kill()
            process.wait()
            for pipe in (process.stdin, process.stdout):
                if pipe is not None:
                    pipe.close()


def release(process: subprocess.Popen[str]) -> int:
    assert process.stdin is not None
    process.stdin.write("go\n")
    process.stdin.flush()
    return process.wait(timeout=HANG_GUARD_S)


def survivors_agree(processes: dict[int, subprocess.Popen[str]], victim: int) -> None:
    """The members other than `victim` formed a group of two without it and ran every kind of
    collective in it."""
    left = [rank for rank in processes if rank != victim]
    for new_rank, rank in enumerate(left):
        assert line_of(processes[rank]) == {
            "lost": f"loader rank {victim} (pod pod-{victim}, node node-{victim})",
            "ranks": left, "rank": new_rank, "generation": 1,
            "gathered": [{"rank": r} for r in left], "all_ready": True,
            "chunks": [left[0] + 1] * 8 + [left[1] + 1] * 8}


def comes_back_dropped(process: subprocess.Popen[str], victim: int, found: str) -> None:
    """The stopped `victim` runs again, and fails saying the others dropped it for `found`."""
    assert process.stdin is not None
    process.stdin.write("go\n")
    process.stdin.flush()
    os.kill(process.pid, signal.SIGCONT)
    error = line_of(process)["error"]
    assert error.startswith(f"this loader (loader rank {victim} (pod pod-{victim}, node "
                            f"node-{victim})) was dropped from its group: the others found "
                            f"that it {found}"), error
    assert process.wait(timeout=HANG_GUARD_S) == 1


def test_the_survivors_of_a_killed_member_form_a_group_and_finish_in_it() -> None:
    with members(victim=2) as processes:
        os.kill(processes[2].pid, signal.SIGKILL)
        survivors_agree(processes, 2)
        assert [release(processes[rank]) for rank in (1, 0)] == [0, 0]


def test_a_stopped_member_is_dropped_and_fails_saying_so_when_it_comes_back() -> None:
    with members(victim=1) as processes:
        os.kill(processes[1].pid, signal.SIGSTOP)
        survivors_agree(processes, 1)
        comes_back_dropped(processes[1], 1, "sent no heartbeat for 2 s")
        assert [release(processes[rank]) for rank in (2, 0)] == [0, 0]


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_the_survivors_of_the_store_host_meet_at_the_next_ranks_store(signum: int) -> None:
    """Rank 0 hosts the store every member joined: the others form their group at rank 1's
    (`group_stores`); a stopped rank 0 that comes back finds it was dropped."""
    with members(victim=0) as processes:
        os.kill(processes[0].pid, signum)
        survivors_agree(processes, 0)
        if signum == signal.SIGSTOP:
            comes_back_dropped(processes[0], 0, "stopped answering")
        assert [release(processes[rank]) for rank in (2, 1)] == [0, 0]
