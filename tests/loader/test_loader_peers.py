"""The heartbeat's verdicts (`peers.PeerWatch`) over an in-memory store and a clock the test
moves: a silent member, a member that left failing, the store's host gone silent, a verdict
another member posted. The real thing, with gloo and killed or stopped loaders, is in
`test_loader_group`."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable

import pytest

from dlo_loader.errors import GroupError
from dlo_loader.members import Member
from dlo_loader.peers import PeerWatch

MEMBERS = [Member(0, "p-0", "n-0"), Member(1, "p-1", "n-1"), Member(2, "p-2", "n-2")]
TIMEOUT_S = 0.8


class Store:
    """The few calls of torch's TCPStore the watch makes; `hang` makes every call block (a
    store whose host is stopped)."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.hang = threading.Event()
        self.hanging = threading.Event()
        """Set once a call blocks on `hang`."""
        self.rounds = threading.Semaphore(0)
        """Released after each round of beats (a member's own beat is its round's first call)."""

    def _blocked(self) -> None:
        if self.hang.is_set():
            self.hanging.set()
            threading.Event().wait()

    def set(self, key: str, value: str) -> None:
        self._blocked()
        self.values[key] = value.encode()

    def add(self, key: str, amount: int) -> int:
        self._blocked()
        value = int(self.values.get(key, b"0")) + amount
        self.values[key] = str(value).encode()
        return value

    def get(self, key: str) -> bytes:
        self._blocked()
        return self.values[key]

    def check(self, keys: list[str]) -> bool:
        self._blocked()
        found = all(key in self.values for key in keys)
        if keys == ["dlo/lost"]:  # the last call of a round
            self.rounds.release()
        return found


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def watch(rank: int, store: Store, clock: Clock) -> PeerWatch:
    return PeerWatch(rank=rank, members=MEMBERS, timeout_s=TIMEOUT_S, connect=lambda: store,
                     clock=clock)


def after_rounds(store: Store, count: int = 2) -> None:
    """Until the watch has made `count` more rounds (a hang guard bounds each)."""
    for _ in range(count):
        assert store.rounds.acquire(timeout=30), "the watch made no round"


def until(predicate: Callable[[], bool], store: Store) -> None:
    for _ in range(100):
        if predicate():
            return
        after_rounds(store, 1)
    raise AssertionError("the watch never reached it")


def test_a_member_whose_beats_stop_is_named_after_the_timeout() -> None:
    store, clock = Store(), Clock()
    mine = watch(0, store, clock)
    after_rounds(store)
    assert mine.lost() is None
    for _ in range(2):  # rank 2 beats, rank 1 does not
        clock.now += TIMEOUT_S * 0.75
        store.add("dlo/beat/2", 1)
        after_rounds(store)
    loss = mine.lost()
    assert loss is not None and loss.member == MEMBERS[1]
    assert str(loss.error()) == (
        "loader rank 1 (pod p-1, node n-1) sent no heartbeat for 0.8 s (loader.peer_timeout_s): "
        "it died, was stopped or is cut off; this loader stops too and publishes nothing")
    until(lambda: "dlo/lost" in store.values, store)  # posted for the others to adopt
    assert json.loads(store.values["dlo/lost"])["rank"] == 1
    mine.leave()


def test_a_member_that_left_failing_is_named_with_its_reason_and_one_that_finished_is_not(
) -> None:
    store, clock = Store(), Clock()
    mine = watch(2, store, clock)
    store.set("dlo/left/0", json.dumps({"ok": True, "why": ""}))
    after_rounds(store)
    assert mine.lost() is None
    store.set("dlo/left/1", json.dumps({"ok": False, "why": "terminated by SIGTERM"}))
    until(lambda: mine.lost() is not None, store)
    loss = mine.lost()
    assert loss is not None and (loss.member, loss.how) == (
        MEMBERS[1], "left the group: terminated by SIGTERM")
    mine.leave()


def test_a_silent_store_names_its_host_and_a_posted_verdict_is_adopted() -> None:
    store, clock = Store(), Clock()
    adopting = watch(2, store, clock)
    store.set("dlo/lost", json.dumps({"rank": 1, "how": "sent no heartbeat"}))
    until(lambda: adopting.lost() is not None, store)
    adopted = adopting.lost()
    assert adopted is not None and (adopted.member, adopted.how) == (MEMBERS[1],
                                                                     "sent no heartbeat")
    adopting.leave()

    other, clock = Store(), Clock()
    mine = watch(1, other, clock)
    after_rounds(other)
    other.hang.set()  # rank 0, the store's host, is stopped: calls to it never return
    assert other.hanging.wait(timeout=30), "the watch asked the store nothing"
    clock.now += 2 * TIMEOUT_S
    loss = mine.lost()
    assert loss is not None and loss.member == MEMBERS[0]
    assert loss.how.startswith("stopped answering: the group's store it hosts has not answered "
                               "for 0.8 s (loader.peer_timeout_s)")


def test_a_member_the_others_dropped_says_so_when_it_comes_back() -> None:
    store, clock = Store(), Clock()
    returning = watch(2, store, clock)  # stopped while the others judged it, then continued
    store.set("dlo/lost", json.dumps({"rank": 2, "how": "sent no heartbeat for 0.8 s"}))
    until(lambda: returning.lost() is not None, store)
    with pytest.raises(GroupError, match=r"this loader \(loader rank 2 \(pod p-2, node n-2\)\) "
                                         r"was dropped from its group: the others found that it "
                                         r"sent no heartbeat for 0.8 s; they finish without it"):
        returning.call(lambda: None)
    returning.leave()
