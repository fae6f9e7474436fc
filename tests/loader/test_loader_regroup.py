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


def survivors_agree(results: list[dict[str, Any]], lost: str) -> None:
    for rank, result in enumerate(results):
        assert result == {"lost": lost, "ranks": [0, 1], "rank": rank, "generation": 1,
                          "gathered": [{"rank": 0}, {"rank": 1}], "all_ready": True,
                          "chunks": [1] * 8 + [2] * 8}


def test_the_survivors_of_a_killed_member_form_a_group_and_finish_in_it() -> None:
    with members(victim=2) as processes:
        os.kill(processes[2].pid, signal.SIGKILL)
        survivors_agree([line_of(processes[rank]) for rank in (0, 1)],
                        "loader rank 2 (pod pod-2, node node-2)")
        assert [release(processes[rank]) for rank in (1, 0)] == [0, 0]


def test_a_stopped_member_is_dropped_and_fails_saying_so_when_it_comes_back() -> None:
    with members(victim=1) as processes:
        os.kill(processes[1].pid, signal.SIGSTOP)
        results = [line_of(processes[rank]) for rank in (0, 2)]
        for new_rank, result in enumerate(results):
            assert result == {"lost": "loader rank 1 (pod pod-1, node node-1)", "ranks": [0, 2],
                              "rank": new_rank, "generation": 1,
                              "gathered": [{"rank": 0}, {"rank": 2}], "all_ready": True,
                              "chunks": [1] * 8 + [3] * 8}
        assert processes[1].stdin is not None
        processes[1].stdin.write("go\n")
        processes[1].stdin.flush()
        os.kill(processes[1].pid, signal.SIGCONT)
        error = line_of(processes[1])["error"]
        assert error.startswith("this loader (loader rank 1 (pod pod-1, node node-1)) was "
                                "dropped from its group: the others found that it sent no "
                                "heartbeat for 2 s"), error
        assert processes[1].wait(timeout=HANG_GUARD_S) == 1
        assert [release(processes[rank]) for rank in (2, 0)] == [0, 0]




@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_the_store_host_lost_still_fails_every_survivor_naming_it(signum: int) -> None:
    """Rank 0 hosts the store the survivors would regroup over: they fail, naming it."""
    with members(victim=0) as processes:
        os.kill(processes[0].pid, signum)
        for rank in (1, 2):
            error = line_of(processes[rank])["error"]
            assert error.startswith("loader rank 0 (pod pod-0, node node-0) "), error
            assert error.endswith("; this loader stops too and publishes nothing"), error
            assert processes[rank].wait(timeout=HANG_GUARD_S) == 1
