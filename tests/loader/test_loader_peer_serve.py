"""The bound on what a loader serves to refilling peers: the throttle's arithmetic on a clock the
test moves (no timing), and every byte an `EntryServer` sends passing through it."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.cache_helpers import publish_files

from dlo_contract.cache import CacheRoot, open_entry
from dlo_contract.fill_group import FillGroup, Holder
from dlo_contract.names import FILL_GROUP_ENV, NODE_NAME_ENV
from dlo_loader.group_source import peer_holders
from dlo_loader.peer_serve import ACCESS_HEADER, PIECE_BYTES, EntryServer, Throttle, access_key

MIB = 1 << 20
SECRET = b"the DOD's fill secret, 32 bytes."


class FakeClock:
    """A clock that moves only when the throttle sleeps or the test advances it."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_the_throttle_holds_the_bytes_sent_to_its_rate_after_one_second_of_burst() -> None:
    clock = FakeClock()
    throttle = Throttle(4 * MIB, clock=lambda: clock.now, sleep=clock.sleep)
    for _ in range(40):
        throttle.take(MIB)
    assert sum(clock.slept) == 9.0  # 40 MiB at 4 MiB/s, the first 4 MiB free
    assert 40 * MIB <= throttle.rate * (clock.now + 1)


def test_the_throttle_lets_idle_time_refill_at_most_one_second_of_bytes() -> None:
    clock = FakeClock()
    throttle = Throttle(2 * MIB, clock=lambda: clock.now, sleep=clock.sleep)
    throttle.take(2 * MIB)
    clock.now += 100.0  # idle: the bucket fills up to its one second, no more
    throttle.take(2 * MIB)
    assert clock.slept == []
    throttle.take(MIB)
    assert clock.slept == [0.5]


class Recorder:
    """A throttle that records what it was asked to let through."""

    def __init__(self) -> None:
        self.taken: list[int] = []

    def take(self, count: int) -> None:
        self.taken.append(count)


def test_every_byte_an_entry_server_sends_goes_through_its_throttle(tmp_path: Path) -> None:
    data = bytes(range(256)) * (3 * PIECE_BYTES // 256 + 7)
    root = CacheRoot(tmp_path / "cache")
    eid = publish_files(root, "s3://b/m/", {"model.safetensors": data})
    served: list[int] = []
    recorder = Recorder()
    with open_entry(root, eid) as entry:
        server = EntryServer(entry, recorder, served.append,  # type: ignore[arg-type]
                             secret=SECRET)
        statuses: list[str] = []
        body = b"".join(server({
            "REQUEST_METHOD": "GET", "PATH_INFO": f"/entries/{eid}/files/model.safetensors",
            "HTTP_RANGE": f"bytes=5-{len(data) - 2}",
            "HTTP_" + ACCESS_HEADER.upper().replace("-", "_"): access_key(
                SECRET, entry.manifest.identity)}, lambda status, headers: statuses.append(status)))
    assert statuses == ["206 Partial Content"]
    assert body == data[5:-1]
    assert sum(recorder.taken) == sum(served) == len(body)
    assert max(recorder.taken) <= PIECE_BYTES


def test_a_loader_reads_the_holders_of_other_nodes_from_the_fill_group_document(
        monkeypatch: pytest.MonkeyPatch) -> None:
    here, there = Holder("node-b", "10.0.0.2", 9400), Holder("node-a", "10.0.0.1", 9400)
    monkeypatch.setenv(FILL_GROUP_ENV, FillGroup(holders=(there, here)).to_json())
    monkeypatch.setenv(NODE_NAME_ENV, "node-b")
    assert peer_holders() == (there,)
    monkeypatch.setenv(FILL_GROUP_ENV, "not json")
    assert peer_holders() == ()
