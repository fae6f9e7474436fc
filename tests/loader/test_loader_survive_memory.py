"""The survivors of a lost member stay within `loader.memory_limit_bytes`, with real
`dlo cache fill` processes over gloo on loopback: the chunks each read and never sent are
written to its tmp dir and their buffers freed with the first exchange's idle ones before the
survivors' exchange takes its budget (`Exchange.settle`), which is charged with the buffers still
alive. Each loader logs the most bytes its chunk and round buffers held at once (counted as each
buffer is made and freed: `exchange_budget.BUFFERS`), and that is within the limit."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest
from dlo_bench.faultproxy import FaultPlan
from dlo_bench.s3server import S3Server
from support.loader_fleet import CHUNK_BYTES, Checkpoint, Fleet, entry_files, included
from test_loader_group import proxies, signalled_mid_fill

pytestmark = pytest.mark.slow
LIMIT = 16 * CHUNK_BYTES
"""Two rounds in flight for three loaders (3N + 4 chunks), and reads ahead for each."""
PEAK = re.compile(r"exchange: chunk buffers held at most (\d+) bytes at once "
                  rf"\(loader\.memory_limit_bytes={LIMIT}\)")


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
