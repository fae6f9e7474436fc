"""The survivors of a lost member stay within `loader.memory_limit_bytes`, with real
`dlo cache fill` processes over gloo on loopback: the chunks each read and never sent are
written to its tmp dir and their buffers freed with the first exchange's idle ones before the
survivors' exchange takes its budget (`Exchange.settle`), which is charged with the buffers still
alive. Each loader logs the most bytes its chunk and round buffers held at once (counted as each
buffer is made and freed: `exchange_budget.BUFFERS`), and that is within the limit."""

from __future__ import annotations

import gc
import re
import signal
import weakref
from pathlib import Path

import pytest
from dlo_bench.faultproxy import FaultPlan
from dlo_bench.s3server import S3Server
from dlo_loader.members import Member
from dlo_loader.peers import PeerWatch
from support.loader_fleet import CHUNK_BYTES, Checkpoint, Fleet, entry_files, included
from test_loader_group import proxies, signalled_mid_fill

LIMIT = 16 * CHUNK_BYTES
"""Two rounds in flight for three loaders (3N + 4 chunks), and reads ahead for each."""
PEAK = re.compile(r"exchange: chunk buffers held at most (\d+) bytes at once "
                  rf"\(loader\.memory_limit_bytes={LIMIT}\)")


@pytest.mark.slow
def test_the_survivors_exchange_stays_within_the_memory_limit(
    s3: S3Server, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    # Rank 2's reads are held: the others read ahead into their buffers while they wait for
    # its chunks, and still hold what they read when it is lost.
    with proxies(s3, *[FaultPlan()] * 3) as held:
        held[2].reads_open.clear()
        fleet = Fleet(tmp_path, checkpoint.source, 3, [p.url for p in held],
                      settings={"memory_limit_bytes": LIMIT})
        outcomes = signalled_mid_fill(fleet, held, 2, signal.SIGKILL)
    for outcome in outcomes:
        assert outcome.returncode == 0, outcome.stderr[-3000:]
        assert outcome.summary["without"] == [2]
        assert "exchange: 2 round(s) in flight" in outcome.stderr
        assert entry_files(fleet.root(outcome.rank)) == included(checkpoint.files)
        [peak] = map(int, PEAK.findall(outcome.stderr))
        assert CHUNK_BYTES < peak <= LIMIT


class _Store:
    """The few calls of torch's TCPStore a heartbeat makes, in memory."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.values[key] = value.encode()

    def add(self, key: str, amount: int) -> int:
        self.values[key] = str(int(self.values.get(key, b"0")) + amount).encode()
        return int(self.values[key])

    def get(self, key: str) -> bytes:
        return self.values[key]

    def check(self, keys: list[str]) -> bool:
        return all(key in self.values for key in keys)


class _Work:
    """What a collective's work holds (its round and send buffers), failing as gloo's does when
    a peer's sockets close."""

    def wait(self) -> None:
        raise RuntimeError("Connection closed by peer")


def test_a_failed_group_call_holds_nothing_once_its_error_is_handled() -> None:
    """Why the survivors' budget above once went past the limit: a failed collective's error
    held the call's frame, whose future held the error, a cycle that kept the call's buffers
    alive until Python's cyclic GC happened to run; the survivors' budget counted them or not
    by chance (`BUFFERS.held`). Here the cyclic GC does not run: what the call held must go
    once the error is handled."""
    store = _Store()
    watch = PeerWatch(rank=0, members=[Member(0, "p-0", "n-0"), Member(1, "p-1", "n-1")],
                      timeout_s=600.0, connect=lambda: store)
    work = _Work()
    held = weakref.ref(work)
    gc.disable()
    try:
        with pytest.raises(RuntimeError, match="Connection closed by peer"):
            watch.call(work.wait)
        del work
        watch.call(lambda: None)  # the worker has moved on from the failed call
        assert held() is None
    finally:
        gc.enable()
        watch.leave()
